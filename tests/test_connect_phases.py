"""What a connect builds, creates and registers (sender/connect_report.py), cold and warm.

Issue 17 item 3: a warm connect must rebuild, re-probe, re-create and re-register nothing; replicas
are built once per (layout, rank) per process and come from the disk cache in a fresh one. Counts,
not timings. A real engine (two sglang rank processes) over Mooncake on loopback.
"""
from __future__ import annotations

import threading

import pytest

from p2pweights.control import SglangEngine
from p2pweights.receiver import start_engines
from p2pweights.replica import ModelReplicas
from p2pweights.sender import WeightSender
from p2pweights.sender.buffers import TransferBuffers
from p2pweights.sender.connect_report import COUNTS, PHASES, ConnectPhases
from replica_configs import write_config


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    # the embedding, 8192 x 256 bf16 per rank (4 MiB), is the largest group: larger than 2 MiB slots
    return write_config("qwen3", str(tmp_path_factory.mktemp("connect")), hidden_size=256, intermediate_size=768,
                        num_hidden_layers=2, vocab_size=16384)


@pytest.fixture(scope="module")
def engine(cfg):
    (e,) = start_engines(cfg, "tp=2", count=1, transport="mooncake", name_prefix="phases")
    yield e
    e.close()


def _connect(sender, engine) -> ConnectPhases:
    sender.connect([SglangEngine(engine.url, name=engine.name)])
    return sender.connect_phases


def test_a_warm_connect_builds_creates_and_registers_nothing(cfg, engine, tmp_path):
    replicas = ModelReplicas(cache_dir=str(tmp_path))
    with WeightSender(cfg, transport="mooncake", buffer_size=8 << 20, replicas=replicas) as sender:
        cold = _connect(sender, engine)
        # one sender prepares both ranks of the TP2 engine: one replica each, one agent, one registration
        assert cold.counts["replicas built"] == 2 and cold.counts["replica disk hits"] == 0
        assert cold.counts["agents created"] == 1 and cold.counts["registrations"] == 1
        assert cold.counts["peer connects"] == 2
        assert {"replicas", "waiting for early slots", "buffer allocation + pinning", "registration",
                "peer connect"} <= set(cold.seconds)
        assert set(cold.overlapped_seconds) == {"transport agent"}  # host slots: pinned after the replicas
        assert set(cold.seconds) <= set(PHASES) and set(cold.counts) == set(COUNTS)
        assert {"build_s", "probe_s"} <= set(cold.replica_seconds)
        first = [p.replica for p in sender.prepared]
        for _ in range(2):
            warm = _connect(sender, engine)
            assert warm is not cold
            assert warm.counts["replicas built"] == 0 and warm.counts["replica disk hits"] == 0
            assert warm.counts["agents created"] == 0 and warm.counts["registrations"] == 0
            assert not {"transport agent", "buffer allocation + pinning", "registration",
                        "waiting for early slots"} & set(warm.seconds)
            assert warm.overlapped_seconds == {}
            assert warm.replica_seconds == {}
            assert [p.replica for p in sender.prepared] == first and all(
                a is b for a, b in zip(first, (p.replica for p in sender.prepared)))
    assert replicas.builds == 2


def test_senders_of_one_process_share_replicas_and_a_fresh_process_reads_them_from_disk(cfg, engine, tmp_path):
    replicas = ModelReplicas(cache_dir=str(tmp_path))
    with WeightSender(cfg, transport="mooncake", buffer_size=8 << 20, replicas=replicas) as a:
        assert _connect(a, engine).counts["replicas built"] == 2
    with WeightSender(cfg, transport="mooncake", buffer_size=8 << 20, replicas=replicas) as b:
        second = _connect(b, engine)
        assert second.counts["replicas built"] == 0 and second.counts["replica disk hits"] == 0
        # its own agent and slots: a sender's buffers are its own
        assert second.counts["agents created"] == 1 and second.counts["registrations"] == 1
    fresh = ModelReplicas(cache_dir=str(tmp_path))  # as a new process would: the mappings on disk
    with WeightSender(cfg, transport="mooncake", buffer_size=8 << 20, replicas=fresh) as c:
        from_disk = _connect(c, engine)
        assert from_disk.counts["replicas built"] == 0 and from_disk.counts["replica disk hits"] == 2
        assert set(from_disk.replica_seconds) == {"disk_s"}


def test_a_connect_that_fails_its_checks_connects_no_peer(cfg, engine, tmp_path):
    with WeightSender(cfg, transport="nixl", buffer_size=8 << 20, replicas=ModelReplicas(cache_dir=str(tmp_path))) as s:
        with pytest.raises(Exception, match="mooncake"):  # the engine published for Mooncake
            _connect(s, engine)
        assert s.connect_phases.counts["peer connects"] == 0 and s.prepared == []
        assert s.connect_phases.counts["registrations"] == 0  # the early slots were never taken


def test_a_cold_connect_creates_its_agent_while_the_replicas_build_and_pins_host_slots_after(
        cfg, engine, tmp_path, monkeypatch):
    import p2pweights.transport as transports

    agent, allocated = threading.Event(), threading.Event()
    real_make, real_init = transports.make_sender_transport, TransferBuffers.__init__

    def make(*args, **kwargs):
        t = real_make(*args, **kwargs)
        agent.set()
        return t

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        allocated.set()

    monkeypatch.setattr(transports, "make_sender_transport", make)
    monkeypatch.setattr(TransferBuffers, "__init__", init)
    seen = []

    class Watching(ModelReplicas):
        def get(self, *args, **kwargs):  # the agent exists before any replica is returned: made in parallel
            seen.append((agent.wait(timeout=30), allocated.is_set()))
            return super().get(*args, **kwargs)

    with WeightSender(cfg, transport="mooncake", buffer_size=8 << 20, replicas=Watching(cache_dir=str(tmp_path))) as s:
        phases = _connect(s, engine)
        # host slots are pinned only after the replicas: pinning beside the import stalls it (early_slots.py)
        assert seen == [(True, False)] * 2
        assert allocated.is_set() and s._buffers.slot_bytes == 8 << 20
        assert phases.counts["agents created"] == 1 and phases.counts["registrations"] == 1
        assert set(phases.overlapped_seconds) == {"transport agent"}


def test_slots_grow_to_a_group_larger_than_the_requested_size(cfg, engine, tmp_path):
    with WeightSender(cfg, transport="mooncake", buffer_size=1 << 20, replicas=ModelReplicas(cache_dir=str(tmp_path))) as s:
        phases = _connect(s, engine)
        largest = max(g.nbytes for p in s.prepared for g in p.replica.groups)
        assert largest > 2 << 20 and s._buffers.slot_bytes >= largest
        assert phases.counts["agents created"] == 1 and phases.counts["registrations"] == 1
        # and the grown slots carry an update byte for byte
        from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
        from p2pweights.receiver import check_weights_equal

        with s.update(1) as u:
            for name, tensor in random_checkpoint(checkpoint_tensors(cfg), 5):
                u.push(name, tensor)
        assert check_weights_equal(engine.url, hf_seed=5)["success"]


FRESH_CONNECT = r"""
import json, sys
from p2pweights.control import SglangEngine
from p2pweights.replica import ModelReplicas
from p2pweights.sender import WeightSender
with WeightSender(sys.argv[1], transport="mooncake", buffer_size=8 << 20, replicas=ModelReplicas(cache_dir=sys.argv[2])) as s:
    s.connect([SglangEngine(sys.argv[3], name="phases0")])
    print("RESULT " + json.dumps({"counts": s.connect_phases.counts, "sglang": "sglang" in sys.modules}))
"""


def test_a_fresh_process_connects_from_the_disk_cache_without_importing_sglang(cfg, engine, tmp_path):
    """The cache key used to `import sglang` for its version: seconds of every disk hit."""
    import json
    import subprocess
    import sys

    with WeightSender(cfg, transport="mooncake", buffer_size=8 << 20, replicas=ModelReplicas(cache_dir=str(tmp_path))) as s:
        assert _connect(s, engine).counts["replicas built"] == 2  # the mappings, now on disk
    out = subprocess.run([sys.executable, "-c", FRESH_CONNECT, cfg, str(tmp_path), engine.url],
                         capture_output=True, text=True, timeout=300)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, out.stderr[-3000:]
    result = json.loads(line[0][len("RESULT "):])
    assert result["counts"]["replica disk hits"] == 2 and result["counts"]["replicas built"] == 0
    assert result["sglang"] is False
