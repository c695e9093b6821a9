"""Several senders of one trainer (issue 14, item 4): real sender processes sharing a gloo group,
real receiver processes over Mooncake. Sender 0 controls the session, every sender writes, and the
version is bumped only after every sender's writes; a failure anywhere fails every sender.
"""
from __future__ import annotations

import multiprocessing as mp
import socket
import time
import traceback

import pytest

from p2pweights.control import SglangEngine
from p2pweights.errors import EngineError
from p2pweights.receiver import check_weights_equal, start_engines
from replica_configs import write_config

TIMEOUT = 180


def _sender_main(conn, rank: int, port: int, cfg: str, urls, names, split: str = "") -> None:
    """One trainer rank: join the group, connect, then run the updates the test sends. ``split``:
    "pp", the two ranks are PP stages 0 and 1; "layers", the two senders of one stage split its
    layers (split="layers"); either way each pushes its own tensors to every engine rank."""
    try:
        import torch.distributed as dist

        from p2pweights.models import writer_hf_names
        from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
        from p2pweights.sender import WeightSender

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        how_split = {"pp": {"pp_stage": rank, "pp_size": 2}, "layers": {"split": "layers"}}.get(split, {})
        sender = WeightSender(cfg, group=dist.group.WORLD, transport="mooncake", buffer_size=1 << 20, **how_split)
        sender.connect([SglangEngine(u, name=n) for u, n in zip(urls, names)])
        specs = checkpoint_tensors(cfg)
        layers = sender.config["num_hidden_layers"]
        mine = set(specs) if not split else set(writer_hf_names(specs, layers, sender.pp_stage, sender.pp_size,
                                                                *sender.writer_in_stage()))
        conn.send(("connected", None))
        while True:
            cmd, version, seed, how = conn.recv()
            if cmd == "close":
                break
            # "changed:N": version N of the seed's family changed in 1% of each tensor
            changed = (0.01, int(how.split(":")[1])) if how.startswith("changed:") else None
            items = [(n, t) for n, t in random_checkpoint(specs, seed, changed=changed) if n in mine]
            try:
                with sender.update(version) as u:
                    for i, (name, t) in enumerate(items):
                        if how == "bad-first":
                            u.push(name + ".typo", t)
                        if how == "raise-midway" and i == len(items) // 2:
                            raise RuntimeError(f"sender {rank}: the trainer broke")
                        if how == "sleep-before-last" and i == len(items) - 1:
                            conn.send(("sleeping", None))
                            conn.recv()  # until the test has looked at the engines
                        u.push(name, t)
                    if how == "all":
                        conn.send(("finishing", None))
                conn.send(("done", u.report.to_dict()))
            except Exception as e:  # noqa: BLE001 - the test reads what each sender raised
                conn.send(("failed", {"type": type(e).__name__, "text": str(e), "notes": getattr(e, "__notes__", []),
                                      "outcome": sender._update.outcome if sender._update else ""}))
        sender.close()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))


class Senders:
    def __init__(self, cfg, engines, split: str = ""):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["p2pweights.replica.preload"])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.conns, self.procs = [], []
        for rank in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_sender_main, args=(child, rank, port, cfg, [e.url for e in engines],
                                                       [e.name for e in engines], split), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        self.expect(0, "connected")
        self.expect(1, "connected")

    def expect(self, rank, *kinds):
        c = self.conns[rank]
        assert c.poll(TIMEOUT), f"sender {rank} did not answer {kinds} within {TIMEOUT} s"
        kind, payload = c.recv()
        assert kind != "error", f"sender {rank} crashed:\n{payload}"
        assert kind in kinds, (rank, kind, payload)
        return kind, payload

    def update(self, version, seed, how=("all", "all")):
        for c, h in zip(self.conns, how):
            c.send(("update", version, seed, h))

    def close(self):
        for c in self.conns:
            try:
                c.send(("close", None, None, None))
            except OSError:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cfg = write_config("qwen3", str(tmp_path_factory.mktemp("group")), hidden_size=256, intermediate_size=768,
                       num_hidden_layers=4, vocab_size=4096)
    engines = start_engines(cfg, "tp=2", count=2, transport="mooncake", name_prefix="grp")
    senders = None
    try:
        senders = Senders(cfg, engines)
        yield cfg, engines, senders
    finally:
        if senders is not None:
            senders.close()
        for e in engines:
            e.close()


def _versions(engines):
    return [SglangEngine(e.url).weight_version() for e in engines]


def _generating(engine) -> bool:
    """No weight-update session open (the receiver's word in /server_info), or, from a receiver that
    does not say, begin refused because generation runs."""
    session = SglangEngine(engine.url).server_info().get("p2pw_weight_update")
    if session is not None:
        return session["state"] == "none"
    try:
        SglangEngine(engine.url).begin_weight_update()
    except EngineError as e:
        return "generation is running" in str(e)
    raise AssertionError(f"engine {engine.name} was paused without a session")


def test_the_version_is_bumped_only_after_every_sender_wrote(cluster):
    cfg, engines, senders = cluster
    senders.update("g1", 1, how=("all", "sleep-before-last"))
    senders.expect(1, "sleeping")      # sender 1 holds its last tensor back...
    senders.expect(0, "finishing")     # ...while sender 0 pushed everything and waits in finish
    time.sleep(1.5)
    assert not senders.conns[0].poll(0)  # sender 0 has not returned
    assert _versions(engines) == ["default", "default"]  # and nobody bumped the version
    assert not any(_generating(e) for e in engines)      # the engines are still paused
    senders.conns[1].send("go on")
    _, r0 = senders.expect(0, "done")
    _, r1 = senders.expect(1, "done")
    assert _versions(engines) == ["g1", "g1"]
    assert r0["senders"] == r1["senders"] == 2
    assert r0["control"] and not r1["control"]  # sender 0 drove the session, sender 1 only wrote
    for e in engines:
        assert check_weights_equal(e.url, hf_seed=1)["success"]


def test_a_sender_failing_after_writes_fails_both_and_bumps_nothing(cluster):
    cfg, engines, senders = cluster
    before = _versions(engines)
    senders.update("g2", 2, how=("all", "raise-midway"))
    kind, f1 = senders.expect(1, "failed")
    assert f1["type"] == "RuntimeError" and "stay paused" in f1["outcome"]
    kind, f0 = senders.expect(0, "finishing", "failed")
    if kind == "finishing":
        kind, f0 = senders.expect(0, "failed")
    assert f0["type"] == "UpdateFailed" and "sender 1" in f0["text"] and "the trainer broke" in f0["text"]
    assert "stay paused" in f0["text"]  # the error says what became of the engines
    assert _versions(engines) == before
    assert not any(_generating(e) for e in engines)
    # the next complete update heals them
    senders.update("g3", 3)
    for rank in (0, 1):
        senders.expect(rank, "finishing")
    senders.expect(0, "done")
    senders.expect(1, "done")
    assert _versions(engines) == ["g3", "g3"]
    assert all(_generating(e) for e in engines)
    for e in engines:
        assert check_weights_equal(e.url, hf_seed=3)["success"]


def test_a_sender_failing_before_any_write_fails_both_and_leaves_the_engines_generating(cluster):
    cfg, engines, senders = cluster
    before = _versions(engines)
    senders.update("g4", 4, how=("all", "bad-first"))
    _, f1 = senders.expect(1, "failed")
    _, f0 = senders.expect(0, "failed")
    assert f1["type"] == "UnknownParameter"
    assert f0["type"] == "UpdateFailed" and "sender 1" in f0["text"] and "UnknownParameter" in f0["text"]
    assert "not paused" in f0["text"]
    assert _versions(engines) == before
    assert all(_generating(e) for e in engines)


def test_a_group_writes_deltas_each_sender_to_its_own_ranks_and_sender_0_ends_for_all(cluster):
    """Sender 0 claims each engine's last commit and ends with every sender's manifests; sender 1
    follows its word. Pushing the same weights again writes nothing; new weights are exact."""
    cfg, engines, senders = cluster
    for version, seed in (("d1", 31), ("d2", 31), ("d3", 32)):
        senders.update(version, seed, how=("plain", "plain"))
        _, r0 = senders.expect(0, "done")
        _, r1 = senders.expect(1, "done")
        for e in engines:
            assert check_weights_equal(e.url, hf_seed=seed)["success"]
        if version == "d1":
            continue
        for r in (r0, r1):
            assert r["delta_reason"] == {}, r["delta_reason"]
            assert {x["delta"] for x in r["engines"]} == {True}
            assert 0 < r["base_bytes"] < 1.1 * r["bytes"]  # one base per prepared rank (256 B boundaries), shared
        if version == "d2":  # nothing changed: nothing crossed the wire
            assert r0["bytes_written"] == r1["bytes_written"] == 0
    assert {x["engine"] for x in r0["engines"]} | {x["engine"] for x in r1["engines"]} == {e.name for e in engines}


@pytest.mark.parametrize("split", ["pp", "layers"])
def test_two_writers_of_every_engine_rank_write_deltas_each_into_its_own_part_of_its_area(tmp_path, split):
    """Two PP stages in one group, or two senders of one stage splitting its layers: both write
    every engine rank, each into its own part of the rank's delta area; sender 0 ends with both
    writers' segments and every step is byte-exact. A step that changed 1% of each tensor crosses
    the wire as a few percent of a full update."""
    cfg = write_config("qwen3", str(tmp_path), hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                       vocab_size=4096)
    engines = start_engines(cfg, "tp=2", count=1, transport="mooncake", name_prefix="ppd")
    senders = None
    try:
        senders = Senders(cfg, engines, split=split)
        beside = [0, 0]  # apply calls beside the writes, each sender (sender 1 under sender 0's owner)
        for step in range(3):
            senders.update(f"p{step}", 41, how=(f"changed:{step}",) * 2)
            _, r0 = senders.expect(0, "done")
            _, r1 = senders.expect(1, "done")
            for e in engines:
                assert check_weights_equal(e.url, hf_seed=41, changed_fraction=0.01, changed_steps=step)["success"]
            if step == 0:  # the first update after connect writes in full
                assert r0["bytes_written"] == r0["bytes"] and r1["bytes_written"] == r1["bytes"]
                continue
            for k, r in enumerate((r0, r1)):
                assert r["delta_reason"] == {}, r["delta_reason"]
                assert {x["delta"] for x in r["engines"]} == {True} and {x["rank"] for x in r["engines"]} == {0, 1}
                assert 0 < r["bytes_written"] < 0.1 * r["bytes"], (r["bytes_written"], r["bytes"])
                beside[k] += r["apply_calls_beside"]
                assert r["slots"] >= 3, r["slots"]
        assert _versions(engines) == ["p2"]
        # both writers applied records beside their writes: each fills 3+ slots, and acquiring its third
        # waits for its first slot's writes, whose records then go (apply_beside.py)
        assert all(beside), beside
    finally:
        if senders is not None:
            senders.close()
        for e in engines:
            e.close()
