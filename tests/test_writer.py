"""The pipelined writer through the in-process loopback transport (fault injection only)."""
from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

from p2pweights import _native
from p2pweights.errors import Busy, Closed, InvalidWrite, NotFound, OutOfRegion, TransferTimeout, UpdateFailed
from p2pweights.sender.buffers import TransferBuffers
from p2pweights.sender.writer import EngineState, EngineWriteReport, PipelinedWriter, WriteReport

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
    assert all(e.state is EngineState.OK and e.writes == 4 and e.batches == 4 for e in report.engines)
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
    for e in (0, 2):  # neighbours finished before the stuck engine's deadline (2 s), not at or after it
        assert report.engine(f"engine-{e}").state is EngineState.OK
        assert report.engine(f"engine-{e}").seconds < 2.0
        assert r.regions[e][:4096].tolist() == [1] * 4096 and r.regions[e][4096:8192].tolist() == [2] * 4096
    # one timeout in all: the stuck engine's batches are cancelled together or skipped, never waited
    # for in turn (two timeouts in turn: >= 4 s)
    assert elapsed < 2 * 2.0
    stuck = report.engine("engine-1")
    assert stuck.batches + stuck.skipped_batches == 2 and stuck.bytes == 0
    assert stuck.state is EngineState.FAILED  # the core's word, read as the enum


def test_a_report_reads_each_engines_state_as_the_enum_and_names_only_the_failed_ones():
    def row(name: str, state: str, error: str = "") -> EngineWriteReport:
        return EngineWriteReport(engine=0, name=name, bytes=0, writes=0, batches=0, skipped_batches=0, seconds=0.0,
                                 gbps=0.0, state=state, error=error)

    report = WriteReport([row("a", "ok"), row("b", "failed", "boom"), row("c", "idle")])
    assert [e.state for e in report.engines] == [EngineState.OK, EngineState.FAILED, EngineState.IDLE]
    assert report.failures == {"b": "boom"} and f"{report.engine('a').state}" == "ok"
    with pytest.raises(ValueError, match="'stuck' is not a valid EngineState"):
        row("d", "stuck")  # a state the core added and Python does not know is caught here


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
    assert r.writer.finish().engine("engine-1").state is EngineState.OK


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


def test_a_write_only_goes_out_from_a_slot_the_caller_acquired(rig):
    r = rig(n_engines=1, slots=2)
    write = [(0, 4096, 0, r.addr(0))]
    with pytest.raises(InvalidWrite, match="slot 1 was not acquired"):
        r.writer.submit(1, write)  # never acquired
    s = r.writer.acquire()
    r.writer.release_slot(s)
    with pytest.raises(InvalidWrite, match=f"slot {s} was not acquired"):
        r.writer.submit(s, write)  # given back unused
    s = r.writer.acquire()
    r.writer.submit(s, write)
    with pytest.raises(InvalidWrite, match=f"slot {s} was not acquired"):
        r.writer.submit(s, write)  # already submitted: its writes may still read it
    with pytest.raises(InvalidWrite, match="slot 7 does not exist"):
        r.writer.submit(7, write)
    report = r.writer.finish()
    assert report.engines[0].bytes == 4096 and r.transport.bytes_copied(0) == 4096  # the one legal write only


def test_a_second_writer_over_one_buffer_is_refused_until_the_first_is_closed(rig):
    r = rig(n_engines=1, slots=1)
    s = r.writer.acquire()  # the first writer's slot: a second writer must not hand it out again
    with pytest.raises(Busy, match="already has a writer"):
        PipelinedWriter(r.transport, r.buffers)
    r.writer.release_slot(s)
    r.writer.close()
    other = PipelinedWriter(r.transport, r.buffers)  # closed: the buffer is free for another writer
    other.close()


def test_a_region_that_wraps_past_the_address_space_is_refused_at_add_engine(rig):
    r = rig(n_engines=1)
    top = (1 << 64) - 4096
    with pytest.raises(InvalidWrite, match="runs past the end of the address space"):
        r.writer.add_engine(5, "wraps", [(r.addr(0), 4096), (top, 8192)])
    with pytest.raises(NotFound, match="unknown engine 5"):  # nothing of it was added
        r.writer.submit(r.writer.acquire(), [(0, 16, 5, top + 16)])
    r.writer.add_engine(5, "at-the-top", [(top, 4096)])  # up to the last byte is fine
    with pytest.raises(InvalidWrite, match="runs past the end of the address space"):
        r.transport.register_memory(top, 8192)


def test_close_twice_is_safe_and_a_closed_writer_refuses_work(rig):
    r = rig(n_engines=1)
    for _ in range(2):
        r.writer.close()
        r.transport.close()
        r.buffers.close()
    with pytest.raises(Closed):
        r.writer.acquire(timeout=1.0)
    with pytest.raises(Closed):
        r.buffers.slot_array(0)


def test_acquire_releases_the_gil(rig):
    r = rig(n_engines=1, slots=1)
    r.transport.set_fault(0, delay_s=0.4)
    r.writer.submit(r.writer.acquire(), [(0, 16, 0, r.addr(0))])
    ticks: list[float] = []
    t = threading.Thread(target=lambda: [ticks.append(time.monotonic()) or time.sleep(0.01) for _ in range(10)])
    t.start()
    r.writer.release_slot(r.writer.acquire())  # blocks ~0.4 s: the only slot is being read
    returned = time.monotonic()
    t.join()
    # Holding the GIL while blocked would stop the ticker until acquire returned.
    assert sum(tick < returned for tick in ticks) >= 5, (ticks, returned)


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


def test_a_batch_submitted_while_the_first_is_polled_is_posted_at_once(rig):
    """docs/writer.md: two batches in flight per engine, so the second slot's bytes queue behind
    the first at the transport instead of waiting for it to return."""
    r = rig(n_engines=1, slots=2)
    r.transport.set_fault(0, delay_s=0.5)  # holds each batch 0.5 s before its first byte
    s0 = r.writer.acquire()
    r.writer.submit(s0, [(0, 4096, 0, r.addr(0))])
    time.sleep(0.1)  # the engine's thread is now polling the first batch
    s1 = r.writer.acquire()
    r.writer.submit(s1, [(0, 4096, 0, r.addr(0, 4096))])
    report = r.writer.finish().engine("engine-0")
    assert report.state is EngineState.OK and report.batches == 2
    assert report.peak_inflight == 2


# -- a Python backend behind _native.PyTransport, misbehaving in the ways a real one could --------------
class Backend:
    """Copies each batch at post (ctypes.memmove); poll answers DONE. Hooks replace post/poll/release."""

    name = "fake"

    def __init__(self, post=None, poll=None, release=None):
        self._post, self._poll, self._release = post, poll, release
        self.next = 1

    def register_memory(self, addr, length, location="cpu"):
        pass

    def deregister_memory(self, addr):
        pass

    def connect(self, engine, descriptor):
        pass

    def disconnect(self, engine):
        pass

    def post(self, engine, local, remote, lengths):
        if self._post is not None:
            return self._post()
        for lo, re, n in zip(local, remote, lengths):
            ctypes.memmove(re, lo, n)
        self.next += 1
        return self.next

    def poll(self, request):
        return 0 if self._poll is None else self._poll()

    def release(self, request):
        return None if self._release is None else self._release()

    def close(self):
        pass


@pytest.fixture
def py_rig():
    made = []

    def make(backend: Backend, slots: int = 1, timeout: float = 5.0):
        buffers = TransferBuffers(SLOT, slots, pin="none")
        transport = _native.PyTransport(backend)
        writer = PipelinedWriter(transport, buffers, transfer_timeout=timeout)
        region = np.zeros(1 << 20, dtype=np.uint8)
        transport.connect(0, "fake")
        writer.add_engine(0, "engine-0", [(region.ctypes.data, region.nbytes)])
        made.append((writer, transport, buffers, region))
        return writer, buffers, region

    yield make
    for writer, transport, buffers, _ in made:
        writer.close()
        transport.close()
        buffers.close()


class _Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no text")


class _BadCode(Exception):
    p2pw_code = "not a code"


def _raise(exc):
    def f():
        raise exc
    return f


@pytest.mark.parametrize("hooks, message", [
    ({"post": _raise(RuntimeError("post exploded"))}, "fake post: post exploded"),
    ({"post": _raise(_BadCode("odd code"))}, "fake post: odd code"),
    ({"post": _raise(_Unprintable())}, "unprintable _Unprintable"),
    ({"post": lambda: "request-7"}, "post returned request-7, not a request id"),
    ({"post": lambda: -1}, "not a request id"),
    ({"poll": _raise(ValueError("poll exploded"))}, "fake poll: poll exploded"),
    ({"poll": lambda: "done"}, "poll returned done, not a status code"),
    ({"poll": lambda: 7}, "poll returned 7, not a status code"),
    ({"poll": lambda: (-3, "the engine went away")}, "the engine went away"),
])
def test_a_backend_that_raises_or_answers_nonsense_fails_its_engine_never_the_process(py_rig, hooks, message):
    writer, buffers, region = py_rig(Backend(**hooks))
    writer.submit(writer.acquire(), [(0, 64, 0, region.ctypes.data)])
    with pytest.raises(UpdateFailed) as info:
        writer.finish()
    assert list(info.value.failures) == ["engine-0"]
    assert message in info.value.failures["engine-0"]
    assert writer.pending_batches(0) == 0  # the slot is free again
    assert writer.acquire(timeout=1.0) == 0


@pytest.mark.parametrize("name", ["TIMEOUT", "OUT_OF_REGION", "DEVICE_ERROR"])
def test_a_backend_may_answer_any_native_error_code_and_its_reason_is_kept(py_rig, name):
    from p2pweights.errors import code_of

    writer, buffers, region = py_rig(Backend(poll=lambda: (code_of(name), "the reason")))
    writer.submit(writer.acquire(), [(0, 64, 0, region.ctypes.data)])
    with pytest.raises(UpdateFailed) as info:
        writer.finish()
    assert info.value.failures == {"engine-0": "the reason"}  # not "... not a status code"


def test_finish_is_bounded_by_the_transfer_timeout_when_a_post_blocks(py_rig):
    unblock = threading.Event()
    writer, buffers, region = py_rig(Backend(post=lambda: unblock.wait(30) and 1), timeout=1.0)
    writer.submit(writer.acquire(), [(0, 64, 0, region.ctypes.data)])
    outcome: list = []

    def finish():
        t0 = time.monotonic()
        try:
            writer.finish()
            outcome.append(("returned", time.monotonic() - t0))
        except UpdateFailed as e:
            outcome.append((e, time.monotonic() - t0))

    t = threading.Thread(target=finish)
    t.start()
    t.join(timeout=10.0)
    unblock.set()  # lets the stuck post return, so the writer can be closed either way
    t.join()
    error, elapsed = outcome[0]
    assert isinstance(error, UpdateFailed), error
    assert elapsed < 10.0  # bounded by the 1 s timeout, not by the post (which blocks until unblocked at 10 s)
    assert "had not returned after" in error.failures["engine-0"]
    # The late post lands in no later report; the slot comes free once its write is released.
    assert writer.acquire(timeout=5.0) == 0
    writer.release_slot(0)
    assert writer.finish().engine("engine-0").state is EngineState.IDLE


def test_a_write_the_transport_cannot_cancel_keeps_its_slot_until_it_ends(py_rig):
    """Invariant 2 for Mooncake-like transports: release() after the deadline answers "still
    reading" (IN_PROGRESS) until the abandoned write ends; only then is the slot handed out."""
    ended = threading.Event()
    backend = Backend(poll=lambda: 1, release=lambda: None if ended.is_set() else 1)
    writer, buffers, region = py_rig(backend, slots=1, timeout=0.5)
    writer.submit(writer.acquire(), [(0, 64, 0, region.ctypes.data)])
    with pytest.raises(UpdateFailed, match="transfer timeout"):
        writer.finish()  # the update fails at the deadline; it does not wait for the abandoned write
    assert writer.pending_batches(0) == 1 and writer.draining_batches() == 1
    with pytest.raises(TransferTimeout):
        writer.acquire(timeout=0.3)
    with pytest.raises(Busy, match="engine 'engine-0'.*cannot cancel"):
        writer.acquire()  # no silent hang: past the transfer timeout it says who holds the slots
    ended.set()
    assert writer.acquire(timeout=2.0) == 0
    assert writer.draining_batches() == 0


def test_an_update_whose_slots_are_all_held_by_a_failed_engine_fails_naming_it(py_rig):
    backend = Backend(poll=lambda: 1, release=lambda: 1)  # hung, and never lets go
    writer, buffers, region = py_rig(backend, slots=1, timeout=0.5)
    writer.submit(writer.acquire(), [(0, 64, 0, region.ctypes.data)])
    t0 = time.monotonic()
    with pytest.raises(UpdateFailed, match="engine-0") as info:
        writer.acquire()  # the next slot of the same update
    assert time.monotonic() - t0 < 0.5 + 5.0  # the 0.5 s deadline, not a hang (the backend never lets go)
    assert "transfer timeout" in info.value.failures["engine-0"]
    backend._release = None  # let go, so the fixture can close


def test_closing_the_buffers_with_a_write_in_flight_frees_them_when_it_returns(rig):
    r = rig(n_engines=1, slots=1)
    r.transport.set_fault(0, delay_s=0.3)
    s = r.writer.acquire()
    r.fill(s, 5)
    r.writer.submit(s, [(0, 4096, 0, r.addr(0))])
    r.buffers.close()  # the loopback worker copies from the slot only after this
    assert r.buffers.native.closed and not r.buffers.native.released
    assert r.writer.finish().engine("engine-0").bytes == 4096
    assert r.regions[0][:4096].tolist() == [5] * 4096
    assert r.buffers.native.released
    with pytest.raises(Closed):
        r.writer.submit(r.writer.acquire(timeout=1.0), [(0, 16, 0, r.addr(0))])


def test_a_fenced_engine_gets_no_post_after_its_lease_and_the_others_are_untouched(rig):
    """The data plane obeys the session: after fence(engine, t) no batch is posted to that engine
    once t has passed (a sender stopped past its lease resumes and posts nothing); the batch fails
    the engine with FENCED and not one byte of it lands; another engine's writes go on; a fence of
    +inf (a renewed lease, or an engine without one) lets it post again in the next update."""
    import math

    r = rig(n_engines=2)
    r.writer.fence(0, 0.05)
    time.sleep(0.2)  # the lease ran out while the sender "was stopped"
    s = r.writer.acquire()
    r.fill(s, 7)
    r.writer.submit(s, [(0, SLOT, 0, r.addr(0)), (0, SLOT, 1, r.addr(1))])
    report = r.writer.finish(raise_on_failure=False)
    fenced = report.engine("engine-0")
    assert fenced.state is EngineState.FAILED and fenced.code == int(_native.Code.FENCED)
    assert "lease ended" in fenced.error and fenced.bytes == 0
    assert not r.regions[0].any()  # nothing of the fenced batch landed
    assert report.engine("engine-1").state is EngineState.OK and (r.regions[1][:SLOT] == 7).all()
    r.writer.fence(0, math.inf)
    s = r.writer.acquire()
    r.fill(s, 7)
    r.writer.submit(s, [(0, SLOT, 0, r.addr(0))])
    assert r.writer.finish().engine("engine-0").state is EngineState.OK and (r.regions[0][:SLOT] == 7).all()


def test_fencing_an_unknown_engine_or_nan_is_refused(rig):
    r = rig(n_engines=1)
    with pytest.raises(NotFound):
        r.writer.fence(9, 1.0)
    with pytest.raises(InvalidWrite):
        r.writer.fence(0, float("nan"))
