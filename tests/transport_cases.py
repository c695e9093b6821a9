"""The transport cases, run for Mooncake (test_transport_mooncake.py) and NIXL
(test_transport_nixl.py), each file defining the ``backend`` fixture: real libraries, real receiver
processes, 127.0.0.1. Each receiver registers a 256 MiB region (16 parameters, 4 KiB unpublished gaps) and
checks every byte itself; the sender writes 64 MiB slots, one batch per slot per engine.
"""
from __future__ import annotations

import functools
import time

import numpy as np
import pytest

from p2pweights.errors import LayoutMismatch, OutOfRegion, UpdateFailed, WrongTransport
from p2pweights.sender.buffers import TransferBuffers
from p2pweights.sender.writer import PipelinedWriter
from p2pweights.transport import attach_engine, detach_engine, make_sender_transport
from p2pweights.transport.peer import PeerProcess, pattern, push_pattern

MiB = 1 << 20
SIZE = 256 * MiB
SLOT = 64 * MiB
GAP = 4096


@functools.lru_cache(maxsize=4)
def stream(seed: int) -> np.ndarray:
    return pattern(SIZE, seed)


class Sender:
    """One sender process's transport, slots and writer, with engines attached by publication."""

    def __init__(self, backend: str, timeout: float = 10.0):
        self.transport = make_sender_transport(backend)
        self.buffers = TransferBuffers(SLOT, 2)
        self.transport.register_memory(self.buffers.address, self.buffers.total_bytes, self.buffers.location)
        self.writer = PipelinedWriter(self.transport, self.buffers, transfer_timeout=timeout)
        self.targets: dict[int, tuple[int, str, object]] = {}

    def attach(self, engine: int, peer: PeerProcess) -> None:
        name = f"engine{engine}/rank{peer.publication.rank}"
        attach_engine(self.transport, self.writer, engine, name, peer.publication)
        self.targets[engine] = (engine, name, peer.publication)

    def detach(self, engine: int) -> None:
        detach_engine(self.transport, self.writer, engine)
        del self.targets[engine]

    def push(self, seed: int, **kw):
        return push_pattern(self.writer, self.buffers, list(self.targets.values()), stream(seed), **kw)

    def close(self) -> None:
        self.writer.close()
        self.transport.close()
        self.buffers.close()


@pytest.fixture
def peers(backend):
    started: list[PeerProcess] = []

    def start(rank: int = 0, size: int = SIZE, transport: str | None = None) -> PeerProcess:
        p = PeerProcess(transport or backend, size, params=16, gap=GAP, rank=rank)
        started.append(p)
        return p

    yield start
    for p in started:
        p.close()


@pytest.fixture
def sender(backend):
    made: list[Sender] = []

    def make(timeout: float = 10.0) -> Sender:
        s = Sender(backend, timeout)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_every_byte_lands_in_both_engines_through_the_pipelined_writer(backend, peers, sender):
    a, b = peers(0), peers(1)
    s = sender()
    s.attach(0, a)
    s.attach(1, b)
    for seed in (1, 2):
        report = s.push(seed)
        assert report.ok
        for e in report.engines:
            assert e.bytes == SIZE
            assert e.batches == SIZE // SLOT  # one batch per slot per engine
        assert a.check(seed) == 0
        assert b.check(seed) == 0


def test_killed_engine_fails_the_update_before_its_timeout_naming_it_and_the_other_completes(backend, peers, sender):
    a, b = peers(0), peers(1)
    s = sender(timeout=30.0)
    s.attach(0, a)
    s.attach(1, b)
    killed_at = []
    stream(3)

    def kill_mid_update(k: int) -> None:
        if k == 1:  # slots 0 and 1 are in flight
            b.kill()
            killed_at.append(time.monotonic())

    with pytest.raises(UpdateFailed) as info:
        s.push(3, on_submit=kill_mid_update)
    elapsed = time.monotonic() - killed_at[0]
    # the disconnect failed it, not the 30 s timeout: 10 s leaves room for a loaded host
    assert elapsed < 10, f"the killed engine failed the update only after {elapsed:.2f} s"
    assert list(info.value.failures) == ["engine1/rank1"]
    report = info.value.report
    assert report.engine("engine0/rank0").state == "ok" and report.engine("engine0/rank0").bytes == SIZE
    assert a.check(3) == 0

    # Reconnect a replacement for the lost engine; the next update succeeds on both.
    s.detach(1)
    c = peers(1)
    s.attach(1, c)
    assert s.push(4).ok
    assert a.check(4) == 0 and c.check(4) == 0


def test_stopped_engine_fails_at_the_deadline_and_the_other_completes(backend, peers, sender):
    a, b = peers(0), peers(1)
    s = sender(timeout=3.0)
    s.attach(0, a)
    s.attach(1, b)
    stream(5)  # the pattern is made outside the timed window
    b.stop()
    t0 = time.monotonic()
    with pytest.raises(UpdateFailed) as info:
        s.push(5)
    elapsed = time.monotonic() - t0
    assert list(info.value.failures) == ["engine1/rank1"]
    assert "transfer timeout" in info.value.failures["engine1/rank1"]
    # not before the deadline; well before "never" (a loaded machine delays the failure, it cannot hasten it)
    assert 3.0 <= elapsed < 3.0 + 10, elapsed
    if backend == "nixl":  # NIXL cancels the stopped engine's writes: the update goes on for the others
        assert info.value.report.engine("engine0/rank0").bytes == SIZE
        assert a.check(5) == 0
    # Mooncake cannot cancel them: both slots stay read by the stopped engine (invariant 2), so the
    # update ends there, naming it; engine 0 got what was written before.

    # The engine comes back: reconnect it and the next update succeeds everywhere.
    b.cont()
    s.detach(1)
    s.attach(1, b)
    assert s.push(6).ok
    assert a.check(6) == 0 and b.check(6) == 0


def test_engine_published_for_the_other_transport_is_rejected_at_connect(backend, peers, sender):
    other = "nixl" if backend == "mooncake" else "mooncake"
    p = peers(0, size=16 * MiB, transport=other)
    s = sender()
    with pytest.raises(WrongTransport) as info:
        s.attach(0, p)
    msg = str(info.value)
    assert f"published its weights for {other}" in msg and f"P2PW_TRANSPORT={other}" in msg
    # The backend itself refuses the other transport's descriptor too.
    with pytest.raises(Exception, match=f"published for {other}"):
        s.transport.connect(0, p.publication.descriptor)


def test_out_of_region_and_wrong_size_writes_are_refused_before_anything_is_posted(backend, peers, sender):
    p = peers(0, size=16 * MiB)
    s = sender()
    s.attach(0, p)
    pub = p.publication
    first = min(pub.params.values(), key=lambda t: t.data_ptr)
    gap_addr = first.data_ptr + first.nbytes  # registered with the transport, but not published
    last = max(pub.params.values(), key=lambda t: t.data_ptr)
    for addr, n in ((gap_addr, 8), (first.data_ptr + first.nbytes - 8, 16), (last.data_ptr + last.nbytes, 8),
                    (first.data_ptr - 8, 8)):
        slot = s.writer.acquire()
        s.buffers.slot_array(slot)[:n] = 0xAB
        with pytest.raises(OutOfRegion, match="outside every region"):
            s.writer.submit(slot, [(0, n, 0, addr)])
        s.writer.release_slot(slot)
    # A parameter whose source bytes differ from the engine's numel x element size.
    wrong = [(n, t.nbytes) for n, t in sorted(pub.params.items(), key=lambda kv: kv[1].data_ptr)]
    wrong[3] = (wrong[3][0], wrong[3][1] - 2)
    with pytest.raises(LayoutMismatch, match=r"engine0/rank0.*model\.layers\.3\.weight"):
        s.push(7, params=wrong)
    assert s.writer.finish().engine("engine0/rank0").batches == 0
    assert p.nonzero() == 0  # nothing was written, gaps included
