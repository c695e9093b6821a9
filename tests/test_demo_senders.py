"""`p2pweights demo`'s P2P mode runs its sender processes as a trainer's ranks: one gloo group,
sender 0 controls the engines' session, so from the second step on the engines take deltas
(`--changed-fraction`); a failure of any sender fails the step and is reported, nothing hangs."""
from __future__ import annotations

import pytest

from p2pweights.commands.demo_run import SenderPool, run_demo, run_p2p
from p2pweights.control import SglangEngine
from p2pweights.receiver import start_engines
from p2pweights.sender.delta_writes import FIRST
from replica_configs import write_config


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return write_config("qwen3", str(tmp_path_factory.mktemp("demo_senders")))


@pytest.fixture(scope="module")
def engines(cfg):
    running = start_engines(cfg, "tp=2", count=1, transport="mooncake", name_prefix="demo")
    yield running
    for e in running:
        e.close()


@pytest.mark.parametrize("engines, engine", [(1, "tp=2"), (2, "tp=1")], ids=["1xtp2", "2xtp1"])
def test_the_demo_writes_deltas_after_the_first_step_and_every_step_is_equal(cfg, engines, engine):
    """2xtp1: each sender writes one engine only, so sender 0 claims (and must keep the answer of) an
    engine it writes nothing into, for the other sender to follow."""
    lines = []
    results = run_demo(cfg, engines=engines, engine=engine, senders=2, steps=3, transport="mooncake",
                       modes=("p2p",), changed_fraction=0.01, progress=lines.append)
    assert [r.step for r in results] == [1, 2, 3]
    assert all(r.equal is True and r.seconds > 0 for r in results)  # each engine rank byte for byte
    first, *later = results
    assert first.bytes_written == first.bytes and first.delta_reason == FIRST
    for r in later:  # 1% of the elements changed: records of a few percent of a full write
        assert r.delta_reason == "" and 0 < r.bytes_written < r.bytes / 4, r
    rows = [line for line in lines if line.lstrip().startswith("p2p ")]
    assert "written)" not in rows[0] and all("written)" in row for row in rows[1:])


def test_a_lone_sender_verifies_what_its_deltas_made(cfg, engines):
    results = run_p2p(cfg, engines, senders=1, steps=2, transport="mooncake", check=True, overrides={},
                      progress=lambda line: None, verify="on", changed_fraction=0.05, seed_base=7)
    assert all(r.verified and r.equal is True for r in results)
    assert results[0].delta_reason == FIRST and results[1].delta_reason == ""
    assert results[1].bytes_written < results[1].bytes


def test_a_group_of_senders_verifies_what_all_their_deltas_made(cfg, engines):
    """verify=True in a group: every sender's manifests meet, sender 0 has them applied, then each
    sender digests what it wrote; the second step still moves deltas only."""
    results = run_p2p(cfg, engines, senders=2, steps=2, transport="mooncake", check=True, overrides={},
                      progress=lambda line: None, verify="on", changed_fraction=0.05, seed_base=11)
    assert all(r.verified and r.equal is True for r in results)
    assert results[0].delta_reason == FIRST and results[1].delta_reason == ""
    assert results[1].bytes_written < results[1].bytes


def test_a_step_sender_0_refuses_fails_every_sender_and_the_demo_says_why(cfg, engines):
    for e in engines:  # the engines already hold the version step 1 would set
        SglangEngine(e.url, name=e.name).update_weight_version("p2p-1")
    lines = []
    with pytest.raises(RuntimeError, match="p2p step 1 failed") as err:
        run_p2p(cfg, engines, senders=2, steps=1, transport="mooncake", check=True, overrides={},
                progress=lines.append)
    assert "sender 0: VersionRefused" in str(err.value) and "sender 1: " in str(err.value)
    assert "equal: NO" in lines[-1]
    assert SglangEngine(engines[0].url).weight_version() == "p2p-1"  # refused before any pause


class _LosingPool(SenderPool):
    """Sender 1 dies once its tensors are made, before the step's "go"."""

    def prepare(self, seed, changed=None, plans_wait=0.0):
        waited = super().prepare(seed, changed, plans_wait)
        self.procs[1].kill()
        self.procs[1].join()
        return waited


def test_a_sender_that_dies_fails_the_step_instead_of_hanging_the_others(cfg, engines):
    pool = _LosingPool(cfg, 2, {"transport": "mooncake"}, timeout=120)
    with pytest.raises(RuntimeError, match="sender 1 exited"):
        run_p2p(cfg, engines, senders=2, steps=1, transport="mooncake", check=True, overrides={},
                progress=lambda line: None, pool=pool, timeout=120)
    assert not pool.procs[0].is_alive()  # closed (or killed) with the pool
