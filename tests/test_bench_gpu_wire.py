"""The GPU wire benchmark's family (benchmarks/gpu/bench_gpu_wire.py, issue "Updates at wire speed at
scale" item 3) run on this CPU host: Mooncake over TCP and NIXL over UCX's tcp, a host receiver, host
slots. Every step must be byte-exact, the first update full, the steady 1% steps deltas that write a
fraction of the bytes, and a fresh checkpoint under delta="auto" fall back to a full write."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "gpu"))

import bench_gpu_wire  # noqa: E402

import bench_push  # noqa: E402


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_wire_family_on_host_memory_is_byte_exact_and_deltas_write_a_fraction(transport, tmp_path, monkeypatch):
    for k in ("UCX_TLS", "UCX_NET_DEVICES", "P2PW_MOONCAKE_PROTOCOL"):
        monkeypatch.setenv(k, "")  # the section sets them in os.environ; monkeypatch restores them
        monkeypatch.delenv(k)
    cfg, _, _ = bench_push.synthetic_config(200, str(tmp_path / "model"))
    rows = bench_gpu_wire.section_update_wire(cfg, "tp=2", fraction=0.01, steps=2,
                                              pairs=((transport, "cpu"),), device="cpu")
    updates = [r for r in rows if "update" in r]
    assert [r["update"] for r in updates] == ["v0", "v1", "v2", "v2 again", "fresh 1", "fresh 2"]
    assert all(r["equal"] for r in updates), updates
    by = {r["update"]: r for r in updates}
    assert by["v0"]["bytes_written"] == by["v0"]["bytes"]  # nothing to compare against: full
    for label in ("v1", "v2"):  # 1% of the elements changed: a small part of the bytes written
        assert 0 < by[label]["bytes_written"] < 0.25 * by[label]["bytes"], by[label]
    assert by["v2 again"]["bytes_written"] == by["v2 again"]["bytes"]
    assert by["fresh 1"]["bytes_written"] >= 0.9 * by["fresh 1"]["bytes"]  # auto on new weights: full
    (ratio,) = [r for r in rows if "delta_over_full" in r]
    assert ratio["all_equal"] and ratio["transport"] == f"{transport} tcp"
