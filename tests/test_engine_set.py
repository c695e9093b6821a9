"""Elastic engine sets (sender/engine_set.py, sender/join.py): engines join, leave, restart at the
same address and stay down for an update while the trainer keeps updating the rest. Real receiver
processes over Mooncake; every written engine is checked byte for byte after every update, and an
engine left out keeps the version (and the bytes) it had."""
from __future__ import annotations

import os
import signal
import time

import pytest

from p2pweights.control import SglangEngine
from p2pweights.errors import UpdateFailed
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
from p2pweights.receiver import check_weights_equal, start_engines
from p2pweights.sender import WeightSender
from replica_configs import write_config

FRACTION = 0.01


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cfg = write_config("qwen3", str(tmp_path_factory.mktemp("elastic")), hidden_size=256, intermediate_size=768,
                       num_hidden_layers=2, vocab_size=2048)
    engines = start_engines(cfg, "tp=1", count=3, transport="mooncake", name_prefix="elastic")
    try:
        yield cfg, {e.name: e for e in engines}
    finally:
        for e in engines:
            e.close()


def push(sender, cfg, version: str, step: int, **kw):
    """Version ``step`` of the changed family (1% of the elements changed per step)."""
    with sender.update(version, **kw) as u:
        u.push_many(list(random_checkpoint(checkpoint_tensors(cfg), 5, changed=(FRACTION, step))))
    return u.report


def exact(engine, step: int) -> bool:
    return bool(check_weights_equal(engine.url, hf_seed=5, changed_fraction=FRACTION, changed_steps=step)["success"])


def version(engine) -> str:
    return SglangEngine(engine.url).weight_version()


def states(sender) -> dict[str, str]:
    return {m.name: m.state for m in sender.engines}


def client(engine):
    return SglangEngine(engine.url, name=engine.name)


def test_join_leave_restart_and_an_engine_down_for_one_update(cluster):
    cfg, engines = cluster
    a, b, c = engines["elastic0"], engines["elastic1"], engines["elastic2"]
    sender = WeightSender(cfg, transport="mooncake", engine_timeout=4.0)
    try:
        sender.connect([client(a)])
        push(sender, cfg, "s1", 1)
        assert exact(a, 1) and states(sender) == {"elastic0": "ready"}

        # join (waited for): the kept engine stays a delta, the new one is written in full
        sender.add_engines([client(b)])
        assert states(sender) == {"elastic0": "ready", "elastic1": "ready"}
        r = push(sender, cfg, "s2", 2)
        by = {e.engine: e for e in r.engines}
        assert by["elastic0"].delta and by["elastic0"].bytes_written < by["elastic0"].bytes / 4
        assert not by["elastic1"].delta and by["elastic1"].bytes_written == by["elastic1"].bytes
        assert exact(a, 2) and exact(b, 2) and version(b) == "s2"

        # join in the background: updates go on meanwhile; once ready, the next update attaches it
        sender.add_engines([client(c)], wait=False)
        assert states(sender)["elastic2"] in ("joining", "ready")
        push(sender, cfg, "s3", 3)
        assert exact(a, 3) and exact(b, 3)
        assert sender._join.wait(120)
        r = push(sender, cfg, "s4", 4)
        assert {e.engine for e in r.engines} == {"elastic0", "elastic1", "elastic2"}
        assert exact(c, 4) and version(c) == "s4" and states(sender)["elastic2"] == "ready"

        # leave: the engine removed is written no more, the others go on as deltas
        sender.remove_engines(["elastic1"])
        r = push(sender, cfg, "s5", 5)
        assert {e.engine for e in r.engines} == {"elastic0", "elastic2"} and all(e.delta for e in r.engines)
        assert version(b) == "s4" and exact(b, 4)
        assert exact(a, 5) and exact(c, 5)

        # restart at the same address: another process (new registrations, no base) is re-planned
        # at its begin and written in full; the other engine stays a delta
        before = {m.name: m.instance for m in sender.engines}
        a.restart()
        r = push(sender, cfg, "s6", 6)
        by = {e.engine: e for e in r.engines}
        assert not by["elastic0"].delta and by["elastic2"].delta, by
        assert exact(a, 6) and exact(c, 6) and version(a) == "s6"
        member = {m.name: m for m in sender.engines}["elastic0"]
        assert member.restarts == 1 and member.instance != before["elastic0"]

        # down for one update (killed), skipped under on_engine_down="skip"; back (restarted) next time
        c.kill()
        r = push(sender, cfg, "s7", 7, on_engine_down="skip")
        assert list(r.engines_skipped) == ["elastic2"] and {e.engine for e in r.engines} == {"elastic0"}
        assert "skipped" in str(r) and states(sender)["elastic2"] == "down" and exact(a, 7)
        c.restart()
        r = push(sender, cfg, "s8", 8, on_engine_down="skip")
        assert not r.engines_skipped and exact(c, 8) and exact(a, 8) and states(sender)["elastic2"] == "ready"

        # stopped for one update (the same process comes back, holding an older commit than the
        # sender's base): its claim is forgotten, so it is written in full, never a delta on the wrong base
        leader = c.pids[0]
        os.kill(leader, signal.SIGSTOP)
        try:
            r = push(sender, cfg, "s9", 9, on_engine_down="skip")
        finally:
            os.kill(leader, signal.SIGCONT)
        assert list(r.engines_skipped) == ["elastic2"] and exact(a, 9)
        time.sleep(0.5)
        r = push(sender, cfg, "s10", 10)
        by = {e.engine: e for e in r.engines}
        assert by["elastic0"].delta and not by["elastic2"].delta
        assert exact(c, 10) and exact(a, 10) and version(c) == "s10"
    finally:
        sender.close()


def test_an_engine_down_fails_the_update_by_default_naming_it_and_touches_no_other(cluster):
    cfg, engines = cluster
    a, c = engines["elastic0"], engines["elastic2"]
    sender = WeightSender(cfg, transport="mooncake", engine_timeout=4.0)
    try:
        sender.connect([client(a), client(c)])
        push(sender, cfg, "f1", 1)
        c.kill()
        with pytest.raises(UpdateFailed) as err:
            push(sender, cfg, "f2", 2)
        assert "elastic2" in str(err.value)
        assert version(a) == "f1" and exact(a, 1)  # refused before anything was paused or written
        assert SglangEngine(a.url).server_info()["p2pw_weight_update"]["state"] == "none"
    finally:
        sender.close()
        c.restart()


def test_set_changes_are_refused_mid_update_and_unknown_names_are_named(cluster):
    cfg, engines = cluster
    a, b = engines["elastic0"], engines["elastic1"]
    sender = WeightSender(cfg, transport="mooncake")
    try:
        sender.connect([client(a)])
        with pytest.raises(ValueError, match="no engine named"):
            sender.remove_engines(["nope"])
        with pytest.raises(ValueError, match="already in the set"):
            sender.add_engines([client(a)])
        with sender.update("m1") as u:
            with pytest.raises(Exception, match="in flight"):
                sender.add_engines([client(b)])
            u.push_many(list(random_checkpoint(checkpoint_tensors(cfg), 5, changed=(FRACTION, 1))))
        assert exact(a, 1) and states(sender) == {"elastic0": "ready"}
    finally:
        sender.close()


def test_an_engine_killed_mid_update_fails_alone_under_skip_and_the_others_commit(cluster):
    cfg, engines = cluster
    a, c = engines["elastic0"], engines["elastic2"]
    sender = WeightSender(cfg, transport="mooncake", engine_timeout=4.0)
    try:
        sender.connect([client(a), client(c)])
        push(sender, cfg, "k1", 1)
        items = list(random_checkpoint(checkpoint_tensors(cfg), 5, changed=(FRACTION, 2)))
        with sender.update("k2", on_engine_down="skip") as u:
            u.push_many(items[: len(items) // 2])
            u.pipeline.drain()  # what is placed goes out now: the engine dies with writes behind it
            c.kill()
            u.push_many(items[len(items) // 2:])
        r = u.report
        assert list(r.engines_skipped) == ["elastic2"] and "mid-update" in r.engines_skipped["elastic2"]
        assert version(a) == "k2" and exact(a, 2) and states(sender) == {"elastic0": "ready", "elastic2": "down"}
        c.restart()  # back at the same address, another process: written in full, the other a delta
        r = push(sender, cfg, "k3", 3, on_engine_down="skip")
        by = {e.engine: e for e in r.engines}
        assert not r.engines_skipped and by["elastic0"].delta and not by["elastic2"].delta
        assert exact(a, 3) and exact(c, 3) and states(sender) == {"elastic0": "ready", "elastic2": "ready"}
    finally:
        sender.close()


def test_an_engine_restarted_mid_update_fails_alone_by_default_and_one_killed_fails_the_update(cluster):
    cfg, engines = cluster
    a, c = engines["elastic0"], engines["elastic2"]
    sender = WeightSender(cfg, transport="mooncake", engine_timeout=4.0)
    items = [list(random_checkpoint(checkpoint_tensors(cfg), 5, changed=(FRACTION, k))) for k in (1, 2, 3, 4)]
    try:
        sender.connect([client(a), client(c)])
        push(sender, cfg, "r1", 1)
        # restarted after its begin: another process holds nothing of this update; the rest commits
        with sender.update("r2") as u:
            u.push_many(items[1][: len(items[1]) // 2])
            u.pipeline.drain()
            c.restart()
            u.push_many(items[1][len(items[1]) // 2:])
        r = u.report
        assert list(r.engines_skipped) == ["elastic2"] and "restarted mid-update" in r.engines_skipped["elastic2"]
        assert version(a) == "r2" and exact(a, 2) and version(c) == "default"
        r = push(sender, cfg, "r3", 3)  # re-planned at its begin, written in full
        assert exact(c, 3) and not {e.engine: e for e in r.engines}["elastic2"].delta
        # killed after its begin and not back: the default policy fails the update, naming it
        with pytest.raises(UpdateFailed, match="elastic2"):
            with sender.update("r4") as u:
                u.push_many(items[3][: len(items[3]) // 2])
                u.pipeline.drain()
                c.kill()
                u.push_many(items[3][len(items[3]) // 2:])
        assert version(a) == "r3"  # nobody was told to end: left paused, healed by the next complete update
    finally:
        sender.close()
        c.restart()
