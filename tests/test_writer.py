"""The pipelined writer through the in-process loopback transport (fault injection only)."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from p2pweights import _native
from p2pweights.sender.buffers import TransferBuffers
from p2pweights.errors import InvalidWrite, NotFound, OutOfRegion, TransferTimeout, UpdateFailed
from p2pweights.sender.writer import PipelinedWriter

SLOT = 2 << 20  # one alignment unit


class Rig:
    """A writer over the loopback transport with `n_engines` engines, each owning a 4 MiB region."""

    def __init__(self, n_engines: int = 1, slots: int = 2, timeout: float = 5.0):
        self.buffers = TransferBuffers(SLOT, slots, pin="none")
        self.transport = _native.LoopbackTransport()
        self.transport.register_memory(self.buffers.address, self.buffers.total_bytes)
        self.writer = PipelinedWriter(self.transport, self.buffers, transfer_timeout=timeout)
        self.regions = [np.zeros(4 << 20, dtype=np.uint8) for _ in range(n_engines)]
        for e, region in enumerate(self.regions):
            self.transport.connect(e, "loopback")
            self.writer.add_engine(e, f"engine-{e}", [(region.ctypes.data, region.nbytes)])

    def addr(self, engine: int, offset: int = 0) -> int:
        return self.regions[engine].ctypes.data + offset

    def fill(self, slot: int, value: int) -> None:
        self.buffers.slot_array(slot)[:] = value

    def close(self) -> None:
        self.writer.close()
        self.transport.close()
        self.buffers.close()


@pytest.fixture
def rig():
    rigs = []

    def make(*a, **kw):
        rigs.append(Rig(*a, **kw))
        return rigs[-1]

    yield make
    for r in rigs:
        r.close()


def test_bytes_arrive_and_report_counts_equal_what_was_submitted(rig):
    r = rig(n_engines=2)
    rng = np.random.default_rng(0)
    expected = [np.zeros(4 << 20, np.uint8) for _ in range(2)]
    submitted = {0: 0, 1: 0}
    for step in range(4):
        s = r.writer.acquire()
        data = rng.integers(0, 256, SLOT, dtype=np.uint8)
        r.buffers.slot_array(s)[:] = data
        writes = []
        for e in (0, 1):
            off, n = int(rng.integers(0, SLOT // 2)), int(rng.integers(1, SLOT // 2))
            dst = step * (1 << 20)
            writes.append((off, n, e, r.addr(e, dst)))
            expected[e][dst:dst + n] = data[off:off + n]
            submitted[e] += n
        r.writer.submit(s, writes)
    report = r.writer.finish()
    assert {e.engine: e.bytes for e in report.engines} == submitted
    assert all(e.state == "ok" and e.writes == 4 and e.batches == 4 for e in report.engines)
    for e in (0, 1):
        np.testing.assert_array_equal(r.regions[e], expected[e])


def test_slot_is_reused_only_after_its_writes_return(rig):
    r = rig(n_engines=1, slots=1)
    r.transport.set_fault(0, delay_s=0.5)
    s = r.writer.acquire()
    r.writer.submit(s, [(0, 1024, 0, r.addr(0))])
    assert r.writer.pending_batches(s) == 1
    with pytest.raises(TransferTimeout):
        r.writer.acquire(timeout=0.1)  # the only slot is still being read
    t0 = time.monotonic()
    again = r.writer.acquire()
    waited = time.monotonic() - t0
    assert again == s and r.writer.pending_batches(s) == 0
    assert waited > 0.2  # it really waited for the write, not just the 0.1 s above
    r.writer.release_slot(again)
    assert r.writer.finish().engines[0].bytes == 1024


def test_stuck_engine_delays_only_its_own_writes(rig):
    r = rig(n_engines=3, slots=2, timeout=2.0)
    r.transport.set_fault(1, hang=True)
    t0 = time.monotonic()
    for step in range(2):
        s = r.writer.acquire()
        r.fill(s, step + 1)
        r.writer.submit(s, [(0, 4096, e, r.addr(e, step * 4096)) for e in range(3)])
    with pytest.raises(UpdateFailed) as info:
        r.writer.finish()
    elapsed = time.monotonic() - t0
    report = info.value.report
    assert set(info.value.failures) == {"engine-1"}
    assert "transfer timeout" in info.value.failures["engine-1"]
    for e in (0, 2):  # neighbours finished on time, long before the stuck engine's deadline
        assert report.engine(f"engine-{e}").state == "ok"
        assert report.engine(f"engine-{e}").seconds < 0.5
        assert r.regions[e][:4096].tolist() == [1] * 4096 and r.regions[e][4096:8192].tolist() == [2] * 4096
    # one timeout in all: the stuck engine's batches are cancelled together or skipped, never waited for in turn
    assert elapsed < 2.0 + 1.0
    stuck = report.engine("engine-1")
    assert stuck.batches + stuck.skipped_batches == 2 and stuck.bytes == 0


def test_timeout_fails_the_update_within_timeout_plus_one_second_naming_the_engine(rig):
    r = rig(n_engines=2, timeout=1.0)
    r.transport.set_fault(0, hang=True)
    s = r.writer.acquire()
    r.writer.submit(s, [(0, 4096, 0, r.addr(0)), (0, 4096, 1, r.addr(1))])
    t0 = time.monotonic()
    with pytest.raises(UpdateFailed, match="engine-0") as info:
        r.writer.finish()
    assert time.monotonic() - t0 < 1.0 + 1.0
    assert list(info.value.failures) == ["engine-0"]


def test_failed_write_never_leaves_a_slot_locked(rig):
    r = rig(n_engines=1, slots=2)
    r.transport.set_fault(0, fail_after_bytes=0)
    for _ in range(2):
        s = r.writer.acquire()
        r.writer.submit(s, [(0, 4096, 0, r.addr(0))])
    with pytest.raises(UpdateFailed, match="injected failure"):
        r.writer.finish()
    assert [r.writer.pending_batches(i) for i in range(2)] == [0, 0]
    # both slots can be acquired at once again, without waiting
    assert sorted([r.writer.acquire(timeout=0.5), r.writer.acquire(timeout=0.5)]) == [0, 1]


def test_disconnected_engine_fails_naming_it_and_the_next_update_succeeds_after_reconnect(rig):
    r = rig(n_engines=2)
    r.transport.disconnect(1)
    s = r.writer.acquire()
    r.writer.submit(s, [(0, 4096, 0, r.addr(0)), (0, 4096, 1, r.addr(1))])
    with pytest.raises(UpdateFailed) as info:
        r.writer.finish()
    assert list(info.value.failures) == ["engine-1"] and "disconnected" in info.value.failures["engine-1"]
    r.transport.connect(1, "loopback")
    s = r.writer.acquire()
    r.writer.submit(s, [(0, 4096, 1, r.addr(1))])
    assert r.writer.finish().engine("engine-1").state == "ok"


@pytest.mark.parametrize(
    "write, error, match",
    [
        ((SLOT - 10, 11, 0, 0), InvalidWrite, "past the slot end"),
        ((0, 0, 0, 0), InvalidWrite, "lengths > 0"),
        ((0, -5, 0, 0), InvalidWrite, "lengths > 0"),
        ((-1, 5, 0, 0), InvalidWrite, "offsets must be >= 0"),
        ((0, 16, 7, 0), NotFound, "unknown engine 7"),
        ((0, 16, 0, "past_region"), OutOfRegion, "outside every region engine 'engine-0' published"),
    ],
)
def test_bad_writes_raise_clear_errors_before_anything_is_posted(rig, write, error, match):
    r = rig(n_engines=1)
    if write[3] == "past_region":
        write = (write[0], write[1], write[2], r.addr(0, (4 << 20) - 8))
    elif write[3] == 0 and write[2] == 0:
        write = (write[0], write[1], write[2], r.addr(0))
    s = r.writer.acquire()
    good = (0, 16, 0, r.addr(0, 1 << 20))
    with pytest.raises(error, match=match):
        r.writer.submit(s, [good, write])
    assert r.transport.bytes_copied(0) == 0  # not even the good write went out
    r.writer.release_slot(s)  # the slot is still the caller's
    assert r.writer.finish().engines[0].bytes == 0


def test_close_twice_is_safe(rig):
    r = rig(n_engines=1)
    for _ in range(2):
        r.writer.close()
        r.transport.close()
        r.buffers.close()


def test_acquire_releases_the_gil(rig):
    r = rig(n_engines=1, slots=1)
    r.transport.set_fault(0, delay_s=0.4)
    r.writer.submit(r.writer.acquire(), [(0, 16, 0, r.addr(0))])
    ticks = []
    t = threading.Thread(target=lambda: [ticks.append(time.sleep(0.01)) for _ in range(10)])
    t.start()
    r.writer.release_slot(r.writer.acquire())
    t.join()
    assert len(ticks) == 10


def test_waiting_on_a_stuck_engine_does_not_busy_wait(rig):
    """Invariant 5: pollers back off and sleep (2-core machines)."""
    r = rig(n_engines=1, timeout=1.5)
    r.transport.set_fault(0, hang=True)
    r.writer.submit(r.writer.acquire(), [(0, 4096, 0, r.addr(0))])
    cpu0, wall0 = time.process_time(), time.monotonic()
    with pytest.raises(UpdateFailed):
        r.writer.finish()
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    assert wall > 1.0
    assert cpu < 0.3 * wall  # a spinning poller would burn a whole core for the whole wait
