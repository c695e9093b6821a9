"""The broadcast baseline end to end: 2 receiver engines x TP2 (real processes), one BroadcastSender
(gloo on 127.0.0.1) pushing full HF tensors in buckets through sglang's routes; every engine rank
loads them with its own sglang loader and the equality check passes."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from replica_configs import write_config  # noqa: E402

from p2pweights.baseline.broadcast import BroadcastSender  # noqa: E402
from p2pweights.control import SglangEngine  # noqa: E402
from p2pweights.errors import EngineError  # noqa: E402
from p2pweights.receiver.engine import check_weights_equal, start_engines  # noqa: E402
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    config = write_config("qwen3", str(tmp_path_factory.mktemp("configs")))
    engines = start_engines(config, "tp=2", count=2, transport="mooncake", name_prefix="bcast")
    yield config, engines
    for e in engines:
        e.close()


def test_broadcast_update_reaches_every_rank_of_every_engine_and_equals_sglangs_loader(setup):
    config, engines = setup
    specs = checkpoint_tensors(config)
    total = sum(s.nbytes for s in specs.values())
    with BroadcastSender([e.url for e in engines], backend="gloo", bucket_bytes=64 << 10) as sender:
        assert sender.world_size == 5  # the sender + 2 engines x 2 ranks
        for step, seed in enumerate((21, 22)):
            report = sender.update(random_checkpoint(specs, seed), version=step)
            assert report.bytes == total and report.tensors == len(specs) and report.buckets > 1
            assert report.seconds > 0
            for e in engines:
                result = check_weights_equal(e.url, hf_seed=seed)
                assert result["success"], result["message"]
                assert SglangEngine(e.url).weight_version() == str(step)


def test_update_weights_from_distributed_needs_an_open_session_like_sglang(setup):
    _, engines = setup
    with pytest.raises(EngineError, match="between begin_weight_update"):
        SglangEngine(engines[0].url).update_weights_from_distributed(["model.norm.weight"], ["bfloat16"], [[64]],
                                                                     group_name="nope")
