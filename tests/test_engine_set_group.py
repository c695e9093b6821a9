"""A group of two senders (real processes sharing a gloo group) agreeing on a change of the engine
set (sender/join.py): an engine added in the background by both is attached by both at the same
update -- each sender writing the engine ranks the plan gives it -- and written in full and byte
for byte; senders whose engine lists differ are refused at the next update, both of them, before
anything is paused. Real receiver processes over Mooncake."""
from __future__ import annotations

import multiprocessing as mp
import socket
import traceback

import pytest

from p2pweights.control import SglangEngine
from p2pweights.receiver import check_weights_equal, start_engines
from replica_configs import write_config

TIMEOUT = 240
FRACTION = 0.01


def _sender_main(conn, rank: int, port: int, cfg: str, first) -> None:
    try:
        import torch.distributed as dist

        from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
        from p2pweights.sender import WeightSender

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        sender = WeightSender(cfg, group=dist.group.WORLD, transport="mooncake")
        sender.connect([SglangEngine(u, name=n) for u, n in first])
        specs = checkpoint_tensors(cfg)
        conn.send(("connected", None))
        while True:
            cmd, arg = conn.recv()
            if cmd == "close":
                break
            try:
                if cmd == "add":
                    sender.add_engines([SglangEngine(u, name=n) for u, n in arg], wait=False)
                    sender._join.wait(TIMEOUT)
                    conn.send(("ok", {m.name: m.state for m in sender.engines}))
                elif cmd == "remove":
                    sender.remove_engines(arg)
                    conn.send(("ok", None))
                else:
                    version, step = arg
                    with sender.update(version) as u:
                        u.push_many(list(random_checkpoint(specs, 5, changed=(FRACTION, step))))
                    conn.send(("done", {"report": u.report.to_dict(), "targets": sorted(
                        t.name for p in sender.prepared for t in p.targets)}))
            except Exception as e:  # noqa: BLE001 - the test reads what each sender raised
                conn.send(("failed", {"type": type(e).__name__, "text": str(e)}))
        sender.close()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        conn.send(("error", traceback.format_exc()))


class Senders:
    def __init__(self, cfg, first):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["p2pweights.replica.preload"])
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.conns, self.procs = [], []
        for rank in range(2):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_sender_main, args=(child, rank, port, cfg, first), daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)
        for rank in (0, 1):
            self.expect(rank, "connected")

    def expect(self, rank, *kinds):
        c = self.conns[rank]
        assert c.poll(TIMEOUT), f"sender {rank} did not answer {kinds} within {TIMEOUT} s"
        kind, payload = c.recv()
        assert kind != "error", f"sender {rank} crashed:\n{payload}"
        assert kind in kinds, (rank, kind, payload)
        return payload

    def both(self, cmd, arg, *kinds):
        for c in self.conns:
            c.send((cmd, arg))
        return [self.expect(rank, *kinds) for rank in (0, 1)]

    def close(self):
        for c in self.conns:
            try:
                c.send(("close", None))
            except OSError:
                pass
        for p in self.procs:
            p.join(30)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    cfg = write_config("qwen3", str(tmp_path_factory.mktemp("elastic-group")), hidden_size=256,
                       intermediate_size=768, num_hidden_layers=2, vocab_size=2048)
    engines = start_engines(cfg, "tp=2", count=2, transport="mooncake", name_prefix="eg")
    senders = None
    try:
        senders = Senders(cfg, [(engines[0].url, engines[0].name)])
        yield cfg, engines, senders
    finally:
        if senders is not None:
            senders.close()
        for e in engines:
            e.close()


def exact(engine, step: int) -> bool:
    return bool(check_weights_equal(engine.url, hf_seed=5, changed_fraction=FRACTION, changed_steps=step)["success"])


def test_two_senders_agree_on_a_join_and_refuse_lists_that_differ(group):
    cfg, (a, b), senders = group
    r0, r1 = senders.both("update", ("g1", 1), "done")
    assert r0["targets"] == ["eg0/rank0"] and r1["targets"] == ["eg0/rank1"]  # one rank each
    assert exact(a, 1)

    joined = senders.both("add", [(b.url, b.name)], "ok")
    assert all(j["eg1"] == "joining" for j in joined)  # ready, attached by the next update
    r0, r1 = senders.both("update", ("g2", 2), "done")
    assert r0["targets"] == ["eg0/rank0", "eg1/rank0"] and r1["targets"] == ["eg0/rank1", "eg1/rank1"]
    for r in (r0, r1):
        by = {e["engine"]: e for e in r["report"]["engines"]}
        assert by["eg0"]["delta"] and not by["eg1"]["delta"]  # the kept engine stays a delta; the new one full
    assert exact(a, 2) and exact(b, 2)
    assert SglangEngine(b.url).weight_version() == "g2"

    # sender 0 removes eg1, sender 1 does not: both are refused at the next update, nothing paused
    senders.conns[0].send(("remove", ["eg1"]))
    senders.expect(0, "ok")
    failures = senders.both("update", ("g3", 3), "failed")
    assert all(f["type"] == "SenderGroupError" and "same engines" in f["text"] for f in failures), failures
    assert SglangEngine(a.url).weight_version() == "g2" and exact(a, 2)
    assert SglangEngine(a.url).server_info()["p2pw_weight_update"]["state"] == "none"
