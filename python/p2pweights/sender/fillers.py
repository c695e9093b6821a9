"""Slot fillers: one per slot mode, behind one interface.

A filler decides where a slot's loaders write and how the complete slot reaches the writer; its
``producer`` (sender/slot_producer.py) fills the slot from replayed copy plans where a group has one:

- :class:`HostSlotFiller` (host slots, tensors on the CPU): the loaders write the pinned host slot;
  a complete slot goes to the writer at once.
- :class:`GpuSlotFiller` (GPU slots): the loaders' copies run on the GPU; a complete slot is
  handed over once a CUDA event recorded after them fired (checked before the next loader batch,
  awaited at the next slot's end), so the next slot's loaders (Python on the CPU) overlap this
  slot's copies on the GPU.
- :class:`StagedHostSlotFiller` (host slots, tensors on a GPU): the loaders write a GPU staging
  buffer (gpu_staging.py) and each loader batch is copied out to the host slot by an asynchronous
  D2H; the host slot is taken at the slot's first copy and handed over once its last copy landed.
  A delta update compares the host slot with its bases at the slot's close, after ``landed``.

:class:`SlotHandOver` holds the one slot whose device work is still in flight; every filler of an
update shares it, so that with a single slot the pending slot is handed over before a new one is
acquired (no deadlock).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping

from .report import UpdateTimes


class SlotHandOver:
    """Hands complete slots to the writer: at once, or once the CUDA event of their device work
    fired (at most one such pending slot)."""

    def __init__(self, writer: Any, times: UpdateTimes):
        self.writer = writer
        self.times = times
        self._pending: tuple[int, list, Any] | None = None  # (slot, writes, CUDA event)
        self.beside: Any = None  # apply_beside.AppliesBeside: told of each slot handed over and each acquired

    @property
    def buffers(self) -> Any:
        return self.writer.buffers

    def acquire(self) -> int:
        """A free slot (blocks on the writer). With one slot only, the pending slot holds it:
        hand that over first."""
        if self._pending is not None and self.writer.buffers.num_slots < 2:
            self.flush()
        t0 = time.perf_counter()
        slot = self.writer.acquire()
        self.times.waiting += time.perf_counter() - t0
        if self.beside is not None:  # a slot came free: its writes returned, their records may be applied
            self.beside.poll()
        return slot

    def submit(self, slot: int, rows: list) -> None:
        self.writer.submit(slot, rows)
        self.times.slots += 1
        if self.beside is not None:
            self.beside.submitted(slot)

    def release(self, slot: int) -> None:
        self.writer.release_slot(slot)

    def defer(self, slot: int, rows: list, done: Any) -> None:
        """Hand the slot over once ``done`` (a CUDA event) fired; the previous pending slot goes first."""
        self.flush()
        self._pending = (slot, rows, done)

    def poll(self) -> None:
        """Hand over the pending slot if its device work is done (the writer may start on it)."""
        if self._pending is not None and self._pending[2].query():
            self.flush()

    def flush(self) -> None:
        """Wait for the pending slot's device work, then hand it to the writer."""
        if self._pending is None:
            return
        slot, rows, done = self._pending
        self._pending = None
        t0 = time.perf_counter()
        try:
            done.synchronize()
        except BaseException:
            self.writer.release_slot(slot)
            raise
        self.times.loading += time.perf_counter() - t0
        self.submit(slot, rows)

    def abort(self) -> None:
        """Release the pending slot after its device work landed (a D2H must not land in a slot
        the writer hands out again)."""
        if self._pending is None:
            return
        slot, _, done = self._pending
        self._pending = None
        try:
            done.synchronize()
        finally:
            self.writer.release_slot(slot)


class SlotFiller:
    """The interface: ``open`` a slot (returns the uint8 tensor the loaders write), tell it what
    the loaders ``loaded``, ``close`` it with its writes, or ``abort`` it. ``batch_divisor``: a
    loader batch runs when its HF inputs reach ``slot_bytes // batch_divisor``."""

    batch_divisor = 1

    def __init__(self, handover: SlotHandOver):
        self.handover = handover
        self.slot: int | None = None  # the transfer slot held, if any
        self.target: Any = None  # where this slot's loaders write
        # (rank, placed, tensors, target) -> regions: replayed copy plans or the loaders
        # (sender/slot_producer.py); None: always the replica's loaders
        self.producer: Callable[..., list] | None = None

    def open(self, device: Any) -> Any:
        raise NotImplementedError

    def produce(self, rank: Any, placed: list, tensors: Mapping[str, Any], deferred: list | None = None) -> list:
        """Write one engine rank's placed (group, offset) pairs into the target; their regions. With a
        ``deferred`` list, replayed groups may be left to it instead (sender/slot_producer.py)."""
        if self.producer is None:
            return rank.replica.load_groups(placed, tensors, self.target)
        return self.producer(rank, placed, tensors, self.target, deferred=deferred)

    def loaded(self, extent: int) -> None:
        """The loaders wrote bytes up to ``extent`` of the target."""

    def close(self, rows: list) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        if self.slot is not None:
            self.handover.release(self.slot)
        self.slot, self.target = None, None


class HostSlotFiller(SlotFiller):
    """Loaders write the host transfer slot; a complete slot is submitted at once."""

    def open(self, device: Any) -> Any:
        self.slot = self.handover.acquire()
        self.target = self.handover.buffers.slot_tensor(self.slot)
        return self.target

    def close(self, rows: list) -> None:
        if rows:
            self.handover.submit(self.slot, rows)
        else:
            self.handover.release(self.slot)
        self.slot, self.target = None, None


def _cuda_event_after_loaders(device: Any) -> Any:
    import torch

    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(device))
    return done


class GpuSlotFiller(HostSlotFiller):
    """Loaders copy on the GPU into the GPU transfer slot; the NIC may read it once their kernels
    ran, so the slot is handed over when a CUDA event recorded after them fired, not by blocking now."""

    def __init__(self, handover: SlotHandOver, record_event: Callable[[Any], Any] = _cuda_event_after_loaders):
        super().__init__(handover)
        self._record_event = record_event

    def close(self, rows: list) -> None:
        if rows:
            done = self._record_event(self.target.device)
            self.handover.defer(self.slot, rows, done)
        else:
            self.handover.release(self.slot)
        self.slot, self.target = None, None


class StagedHostSlotFiller(SlotFiller):
    """Loaders write a GPU staging buffer; each batch's new bytes are copied out to the host slot
    by an asynchronous D2H (in quarters of a slot, so one batch's copy overlaps the next batch's
    loaders); the slot is handed over once its last copy landed."""

    batch_divisor = 4

    def __init__(self, handover: SlotHandOver, staging_for: Callable[[Any], Any]):
        super().__init__(handover)
        self._staging_for = staging_for  # device -> GpuStaging of a slot's size on that device
        self._staging: Any = None
        self._extent = 0  # bytes of the staging buffer loaded so far
        self._copied = 0  # of which queued for copy-out into the host slot
        self._last_copy: Any = None  # the event of the slot's latest copy-out

    def open(self, device: Any) -> Any:
        t0 = time.perf_counter()
        self._staging = self._staging_for(device)
        self.target = self._staging.target()  # waits until this buffer's previous copy-out landed
        self.handover.times.loading += time.perf_counter() - t0
        self._extent, self._copied, self._last_copy = 0, 0, None
        return self.target

    def loaded(self, extent: int) -> None:
        self._extent = max(self._extent, extent)
        if self.slot is None:
            self.slot = self.handover.acquire()
        t0 = time.perf_counter()
        host = self.handover.buffers.slot_tensor(self.slot)
        self._last_copy = self._staging.copy_out(host, self._copied, self._extent)
        self._copied = self._extent
        self.handover.times.loading += time.perf_counter() - t0

    def landed(self) -> None:
        """Wait until every copy queued into the host slot landed (its bytes may be read on the host
        now: a delta compare, sender/delta_writes.py). Each copy's event marks the earlier ones done."""
        if self._last_copy is not None:
            t0 = time.perf_counter()
            self._last_copy.synchronize()
            self.handover.times.loading += time.perf_counter() - t0

    def close(self, rows: list) -> None:
        self._staging.advance()
        if self.slot is not None:
            # the previous staged slot's copies ran during this slot's loaders: hand it over now
            if rows:
                self.handover.defer(self.slot, rows, self._last_copy)
            else:
                self.handover.flush()
                self._last_copy.synchronize()
                self.handover.release(self.slot)
        self.slot, self.target, self._last_copy = None, None, None

    def abort(self) -> None:
        if self.slot is not None and self._last_copy is not None:
            self._last_copy.synchronize()  # a queued D2H must land before the slot is reused
        self._last_copy = None
        super().abort()


def slot_mode(buffer_device: str, inputs: Mapping[str, Any]) -> str:
    """``gpu`` for GPU slots; for host slots ``staged`` when the group's inputs are on a GPU, else ``host``."""
    if buffer_device != "cpu":
        return "gpu"
    first = next(iter(inputs.values()))
    return "staged" if getattr(first, "is_cuda", False) else "host"


class FillerChoice:
    """Picks each slot's filler by :func:`slot_mode` from the inputs of its first group."""

    def __init__(self, handover: SlotHandOver, staging_for: Callable[[Any], Any] | None = None,
                 producer: Callable[..., list] | None = None):
        self._device = handover.buffers.device
        self._fillers: dict[str, SlotFiller] = {"host": HostSlotFiller(handover), "gpu": GpuSlotFiller(handover)}
        if staging_for is not None:
            self._fillers["staged"] = StagedHostSlotFiller(handover, staging_for)
        for filler in self._fillers.values():
            filler.producer = producer

    def __call__(self, inputs: Mapping[str, Any]) -> SlotFiller:
        return self._fillers[slot_mode(self._device, inputs)]
