"""pytest-benchmark regression suite for whole updates (tiny shapes, so it runs anywhere).

    PYTHONPATH=python python3 -m pytest benchmarks/test_bench_update.py --benchmark-only \
        --benchmark-json=update.json

Each round is a full update (pause -> writes -> end, version, continue), checked byte for byte
after the timed rounds. Compare runs with pytest-benchmark's --benchmark-compare.
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from p2pweights.control import SglangEngine  # noqa: E402
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint  # noqa: E402
from p2pweights.receiver import check_weights_equal, start_engines  # noqa: E402
from p2pweights.sender import WeightSender  # noqa: E402
from replica_configs import write_config  # noqa: E402


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    return write_config("qwen3", str(tmp_path_factory.mktemp("cfg")), hidden_size=256, intermediate_size=768,
                        num_hidden_layers=4, vocab_size=4096)


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_p2p_update(benchmark, config, transport):
    engines = start_engines(config, "tp=2", count=2, transport=transport, name_prefix=f"b-{transport}-")
    try:
        specs = checkpoint_tensors(config)
        tensors = list(random_checkpoint(specs, 1))
        sender = WeightSender(config, transport=transport, buffer_size=4 << 20)
        sender.connect([SglangEngine(e.url, name=e.name) for e in engines])
        version = iter(range(1, 10**6))

        def update():
            with sender.update(next(version)) as u:
                for name, t in tensors:
                    u.push(name, t)

        benchmark.pedantic(update, rounds=5, warmup_rounds=1)
        assert all(check_weights_equal(e.url, hf_seed=1)["success"] for e in engines)
        sender.close()
    finally:
        for e in engines:
            e.close()


def test_broadcast_update(benchmark, config):
    from p2pweights.baseline.broadcast import BroadcastSender

    engines = start_engines(config, "tp=2", count=2, transport="mooncake", name_prefix="b-bcast-")
    try:
        tensors = list(random_checkpoint(checkpoint_tensors(config), 1))
        version = iter(range(1, 10**6))
        with BroadcastSender([SglangEngine(e.url, name=e.name) for e in engines], backend="gloo") as b:
            benchmark.pedantic(lambda: b.update(tensors, version=next(version)), rounds=5, warmup_rounds=1)
        assert all(check_weights_equal(e.url, hf_seed=1)["success"] for e in engines)
    finally:
        for e in engines:
            e.close()
