"""The pipelined double-buffer writer (native) with the Python edge: typed errors and a report."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from enum import Enum
from typing import Iterable, Sequence

import numpy as np

from .. import _native
from ..errors import Busy, UpdateFailed
from .buffers import TransferBuffers


class EngineState(str, Enum):
    """One engine's state in a writer report (csrc/writer.h's ``EngineState``; the core reports the
    value). A ``str`` enum: it equals its value and prints it, so reports and JSON read the same."""

    IDLE = "idle"      # no write was submitted for it in this update
    OK = "ok"          # every write submitted for it landed
    FAILED = "failed"  # a write failed or timed out; ``error`` says why

    def __str__(self) -> str:
        return self.value


@dataclass
class EngineWriteReport:
    engine: int
    name: str
    bytes: int
    writes: int
    batches: int
    skipped_batches: int
    seconds: float
    gbps: float
    state: EngineState
    error: str = ""
    peak_inflight: int = 0  # most batches posted and not yet returned at once
    code: int = 0  # the native status of the failure (errors.CLASS_OF_CODE names its class): FENCED, TIMEOUT, ...

    def __post_init__(self) -> None:
        self.state = EngineState(self.state)  # the core's string; an unknown one is a ValueError here


@dataclass
class WriteReport:
    engines: list[EngineWriteReport] = field(default_factory=list)

    @property
    def bytes(self) -> int:
        return sum(e.bytes for e in self.engines)

    @property
    def failures(self) -> dict[str, str]:
        return {e.name: e.error for e in self.engines if e.state is EngineState.FAILED}

    @property
    def ok(self) -> bool:
        return not self.failures

    def engine(self, name: str) -> EngineWriteReport:
        for e in self.engines:
            if e.name == name:
                return e
        raise KeyError(name)


class PipelinedWriter:
    """One write thread per engine, N slots; see csrc/writer.h.

    ``acquire()`` blocks (GIL released) until a slot has no writes reading it; fill it; then
    ``submit(slot, writes)`` with writes as (slot offset, length, engine id, remote address).
    ``finish()`` waits for every write and raises :class:`UpdateFailed` naming every failed engine.
    """

    def __init__(self, transport: "_native.Transport", buffers: TransferBuffers, *, transfer_timeout: float = 30.0,
                 max_inflight_batches: int = 2):
        self._buffers = buffers
        self._transport = transport
        self._native = _native.PipelinedWriter(transport, buffers.native, float(transfer_timeout),
                                               int(max_inflight_batches))
        self._engines: dict[int, str] = {}
        self._closed = False

    @property
    def transfer_timeout(self) -> float:
        return self._native.transfer_timeout

    @property
    def buffers(self) -> TransferBuffers:
        return self._buffers

    def add_engine(self, engine: int, name: str, regions: Iterable[tuple[int, int]]) -> None:
        self._native.add_engine(int(engine), str(name), [(int(a), int(n)) for a, n in regions])
        self._engines[int(engine)] = str(name)

    def fence(self, engine: int, seconds: float) -> None:
        """Post nothing to ``engine`` from ``seconds`` from now on (the session's lease, as last
        renewed, less a margin): a later batch fails the engine with :class:`~p2pweights.errors.Fenced`.
        ``math.inf`` lifts the fence; a negative value fences at once."""
        self._native.fence(int(engine), float(seconds))

    def remove_engine(self, engine: int) -> None:
        self._native.remove_engine(int(engine))
        self._engines.pop(int(engine), None)

    def acquire(self, timeout: float | None = None) -> int:
        """A free slot. When every slot is held past the transfer timeout by writes the transport could
        not cancel (Mooncake, an engine stopped mid-write), the update cannot go on: it is finished
        and :class:`UpdateFailed` names the engines that failed; with no failure in this update
        (leftovers of an earlier one) the :class:`Busy` from the core is raised as is."""
        try:
            return self._native.acquire(-1.0 if timeout is None else float(timeout))
        except Busy as busy:
            rows = self._native.finish()
            report = WriteReport([EngineWriteReport(**{k: r[k] for k in EngineWriteReport.__dataclass_fields__})
                                  for r in rows])
            if not report.failures:
                raise
            raise UpdateFailed(report.failures, report) from busy

    def release_slot(self, slot: int) -> None:
        self._native.release_slot(slot)

    def pending_batches(self, slot: int) -> int:
        """Batches still reading the slot (queued, in flight, or released but not let go)."""
        return self._native.pending_batches(slot)

    def draining_batches(self) -> int:
        """Released writes the transport could not cancel; their slots stay taken until they end."""
        return self._native.draining_batches()

    def submit(self, slot: int, writes: Sequence[tuple[int, int, int, int]] | np.ndarray) -> None:
        """writes: rows of (slot offset, length, engine id, remote address)."""
        if isinstance(writes, np.ndarray) and writes.dtype.names:
            off, ln, eng, rem = (writes[k] for k in writes.dtype.names[:4])
        else:
            rows = list(writes)
            off = np.fromiter((w[0] for w in rows), dtype=np.int64, count=len(rows))
            ln = np.fromiter((w[1] for w in rows), dtype=np.int64, count=len(rows))
            eng = np.fromiter((w[2] for w in rows), dtype=np.int32, count=len(rows))
            rem = np.fromiter((w[3] for w in rows), dtype=np.uint64, count=len(rows))
        self._native.submit(int(slot), off, ln, eng, rem)

    def finish(self, *, raise_on_failure: bool = True) -> WriteReport:
        rows = self._native.finish()
        report = WriteReport([EngineWriteReport(**{k: r[k] for k in EngineWriteReport.__dataclass_fields__}) for r in rows])
        if raise_on_failure and report.failures:
            raise UpdateFailed(report.failures, report)
        return report

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._native.close()

    def __enter__(self) -> "PipelinedWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn("PipelinedWriter was not closed; call close()", ResourceWarning, stacklevel=2)
