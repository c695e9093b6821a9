"""The broadcast baseline end to end: 2 receiver engines x TP2 (real processes), one BroadcastSender
(gloo on 127.0.0.1) pushing full HF tensors in buckets through sglang's routes; every engine rank
loads them with its own sglang loader and the equality check passes."""
from __future__ import annotations

import ast
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from p2pweights.baseline.broadcast import BroadcastSender  # noqa: E402
from p2pweights.control import SglangEngine  # noqa: E402
from p2pweights.errors import EngineError  # noqa: E402
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint  # noqa: E402
from p2pweights.receiver import check_weights_equal, start_engines  # noqa: E402
from replica_configs import write_config  # noqa: E402


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


def _private_torch_uses(source: str) -> list[str]:
    """Every ``torch...._name`` the source reaches (an alias of a torch module, then a private name)."""
    tree = ast.parse(source)
    aliases: set[str] = set()
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("torch"))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            found += [f"from {node.module} import {a.name}" for a in node.names if a.name.startswith("_")]
            found += [f"{node.module}.{a.name}" for a in node.names if "._" in f".{node.module}"]
            aliases.update(a.asname or a.name for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                private = [a for a in chain if a.startswith("_") and not a.startswith("__")]
                if private:
                    found.append(".".join([value.id, *reversed(chain)]))
    return found


def test_the_baseline_builds_its_group_from_public_torch_apis_only():
    import p2pweights.baseline.broadcast as broadcast

    with open(broadcast.__file__) as f:
        assert _private_torch_uses(f.read()) == []
    # the check itself sees what the old code used
    old = ("from torch.distributed import distributed_c10d as c10d\n"
           "pg, _ = c10d._new_process_group_helper(1, 0, [], None, None)\nc10d._world.pg_group_ranks[pg] = {}\n")
    assert {"c10d._new_process_group_helper", "c10d._world"} <= set(_private_torch_uses(old))


def test_a_weight_update_group_broadcasts_without_touching_torch_distributeds_global_state():
    import threading

    import torch
    import torch.distributed as dist

    from p2pweights.baseline.broadcast import GroupReceiver, WeightUpdateGroup

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    got = torch.zeros(5)
    joined: dict = {}

    def engine_rank() -> None:
        receiver = GroupReceiver()
        group = receiver.join("gloo", "127.0.0.1", store.port, 2, 1, "g", 30.0)
        receiver.receive(group, got)
        joined["ok"] = True
        receiver.leave(group)

    t = threading.Thread(target=engine_rank)
    t.start()
    sender = WeightUpdateGroup("gloo", "127.0.0.1", store.port, 2, 0, "g", 30.0, store=store)
    sender.broadcast(torch.arange(5.0))
    t.join(30)
    sender.close()
    assert joined.get("ok") and got.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert not dist.is_initialized()  # no default group made, none needed
