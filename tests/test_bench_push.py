"""pytest-benchmark: the sender's host path per tensor at a small size (benchmarks/bench_push.py's
synthetic many-experts model, 400 tensors), every update checked byte for byte; and the benchmark's
command end to end (its JSON rows)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_push  # noqa: E402
from p2pweights.control import SglangEngine  # noqa: E402
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint  # noqa: E402
from p2pweights.receiver import check_weights_equal, start_engines  # noqa: E402
from p2pweights.sender import WeightSender  # noqa: E402


@pytest.fixture(scope="module")
def many_experts(tmp_path_factory):
    cfg, _, _ = bench_push.synthetic_config(400, str(tmp_path_factory.mktemp("push") / "model"))
    (engine,) = start_engines(cfg, "tp=1", count=1, transport="mooncake", name_prefix="push")
    sender = WeightSender(cfg, transport="mooncake")
    sender.connect([SglangEngine(engine.url, name=engine.name)])
    assert sender.recorder is None or sender.recorder.wait(300)
    yield cfg, engine, sender
    sender.close()
    engine.close()


def test_bench_push_many_host_path_per_tensor(benchmark, many_experts):
    cfg, engine, sender = many_experts
    tensors = list(random_checkpoint(checkpoint_tensors(cfg), 3))
    versions = iter(range(1, 10**6))
    updates = []

    def one_update():
        with sender.update(next(versions), delta=False) as u:
            u.push_many(tensors)
        updates.append(u)

    benchmark.pedantic(one_update, rounds=5, iterations=1, warmup_rounds=1)
    assert check_weights_equal(engine.url, hf_seed=3)["success"]
    last = updates[-1].times
    assert last.replayed > 0 and last.loader_groups == 0  # the steady path: copy plans, no loaders
    host_us = 1e6 * (last.staging + last.loading) / len(tensors)
    benchmark.extra_info.update(tensors=len(tensors), host_us_per_tensor=host_us)


def test_bench_push_command_prints_byte_exact_rows_for_both_modes():
    # this process's p2pweights (the installed wheel in CI; PYTHONPATH's, when set) in the child too
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_push.py"), "--tensors", "400",
                          "--updates", "1", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    assert [r["mode"] for r in rows] == ["push", "push_many"]
    assert all(r["equal"] and 350 <= r["tensors"] <= 450 and r["us_per_tensor"] > 0 for r in rows)
