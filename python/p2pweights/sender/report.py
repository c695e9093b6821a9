"""What one update reports: bytes, seconds and where the time went, per update and per engine rank."""
from __future__ import annotations

import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

from ..settings import format_size


@dataclass
class UpdateTimes:
    """Where an update's time went so far; every stage of the slot pipeline adds to it."""

    staging: float = 0.0  # in push(), outside the loaders: checks, staging, transforms, write rows
    loading: float = 0.0  # the replica's loaders filling slots (and their device work)
    waiting: float = 0.0  # blocked on a free slot or on the last writes
    control: float = 0.0  # engine control plane
    groups: int = 0  # parameter groups placed in slots
    slots: int = 0  # slots handed to the writer
    replayed: int = 0  # groups produced by replaying a recorded copy plan (sender/slot_producer.py)
    loader_groups: int = 0  # groups produced by the replica's loaders
    recorded: int = 0  # copy plans recorded (and their first replay checked) in this update
    record_seconds: float = 0.0  # of ``loading``: recording plans and checking their first replay
    # CPU clocks when the update began (see cpu_used): the process's, and the thread that runs the update's
    cpu_process_start: float = field(default_factory=time.process_time)
    cpu_thread_start: float = field(default_factory=time.thread_time)
    cpu_thread: int = field(default_factory=threading.get_ident)

    def cpu_used(self) -> tuple[float, float | None]:
        """CPU seconds since the update began: the whole process's (every thread: the caller's
        loaders and staging, the native writer threads, the transport's threads, and anything else
        the process runs meanwhile, such as a background plan recorder or a trainer's own threads),
        and the calling thread's alone (None when asked from another thread than the one that
        began the update: its clock is per thread)."""
        process = time.process_time() - self.cpu_process_start
        caller = time.thread_time() - self.cpu_thread_start if threading.get_ident() == self.cpu_thread else None
        return process, caller


@dataclass
class EngineRankReport:
    engine: str
    rank: int
    bytes: int
    seconds: float
    gbps: float
    state: str
    error: str = ""
    bytes_written: int = 0  # what crossed the transport for this rank (delta records included); bytes: a full write's
    delta: bool = False  # the engine accepted this sender's base: changed bytes went as delta records
    delta_reason: str = ""  # why this rank got a full write ("" when delta)


@dataclass
class UpdateReport:
    version: str
    seconds: float  # from pause returning (or update start without control) to the update returning
    bytes: int
    groups: int
    slots: int
    staging_seconds: float  # in push(), outside the loaders: checks and staging
    loading_seconds: float  # the replica's loaders filling slots
    writing_seconds: float  # longest engine's first post to last completion
    waiting_seconds: float  # blocked on a free slot or on the last writes
    control_seconds: float  # engine control plane (begin/end/version/continue), outside `seconds`'s writes
    engines: list[EngineRankReport]
    data_seconds: float = 0.0  # from the same start to the last write completed (before end_weight_update)
    validate_seconds: float = 0.0  # version checks at update() and the first push's checks, before the pause
    pause_seconds: float = 0.0  # pause_generation + begin_weight_update (sender 0 of a group; else 0)
    senders: int = 1  # senders of the trainer's group that wrote this update
    skipped: list[str] = field(default_factory=list)  # pushed names the engines load nothing from (tied)
    control: dict[str, float] = field(default_factory=dict)  # control verb -> seconds (this sender's calls)
    replayed_groups: int = 0  # groups produced from recorded copy plans, without the loaders
    loader_groups: int = 0  # groups produced by the loaders (first update, refused groups, plans off)
    recorded_plans: int = 0  # copy plans recorded and verified in this update
    plan_bytes: int = 0  # memory the recorded copy plans of this sender's replicas hold
    background_plans: int = 0  # copy plans of these replicas recorded in the background (P2PW_COPY_PLANS)
    # CPU seconds this update took (UpdateTimes.cpu_used): the sender's process, all threads (with
    # whatever else the process ran meanwhile), and of it the thread that ran update() (loaders,
    # replay, staging, control plane; the rest is the native writer and transport threads); None
    # when the update ended on another thread than it began
    cpu_seconds: float = 0.0
    caller_cpu_seconds: float | None = None
    # deltas (docs/deltas.md): ``bytes`` stays what a full update writes; ``bytes_written`` is what crossed the
    # transport; ``base_bytes`` the sender's copy of what it wrote; ``changed_bytes`` the bytes found changed
    bytes_written: int = 0
    base_bytes: int = 0
    changed_bytes: int = 0
    # parameters a delta update compared straight from the trainer's tensors through their copy
    # programs, without writing them into a slot first (sender/delta_writes.py)
    compared_from_inputs: int = 0
    # delta segments the engine ranks applied beside the writes, in how many p2pw_apply_deltas calls, how
    # long those took together (sender/apply_beside.py); the rest were applied at the end
    segments_applied_beside: int = 0
    apply_calls_beside: int = 0
    apply_beside_seconds: float = 0.0
    # the sender's memory for updates (docs/sender.md, "Memory"): its transfer slots (spare bytes
    # included; in ``slot_location``), the most one prepared engine rank's incomplete parameter groups
    # held at once in this update (tensors pushed and waiting for the rest of their group, which the
    # ranks share: the trainer's own unless made here, a DTensor's gather or a quantize on send), and
    # ``base_bytes``
    slot_bytes: int = 0
    slot_location: str = ""
    staged_peak_bytes: int = 0
    # engines this update left out (on_engine_down="skip"), each with why (docs/sender.md, "The engine set")
    engines_skipped: dict[str, str] = field(default_factory=dict)

    @property
    def memory_bytes(self) -> int:
        """Slots + the incomplete groups' peak + bases: what this sender held for the update."""
        return self.slot_bytes + self.staged_peak_bytes + self.base_bytes

    @property
    def delta_reason(self) -> dict[str, str]:
        """``engine/rankN`` -> why that engine rank got a full write (ranks that took deltas are absent)."""
        return {f"{e.engine}/rank{e.rank}": e.delta_reason for e in self.engines if not e.delta}

    def engine(self, name: str) -> EngineRankReport:
        """The report of one engine rank by its target name (``engine/rankN``)."""
        for e in self.engines:
            if f"{e.engine}/rank{e.rank}" == name:
                return e
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        """Everything as plain JSON types (``json.dumps(report.to_dict())``)."""
        d = asdict(self)
        d["gbps"] = self.gbps
        d["delta_reason"] = self.delta_reason
        d["memory_bytes"] = self.memory_bytes
        return d

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        lines = [
            f"update {self.version}: {format_size(self.bytes)} in {self.seconds:.3f} s ({self.gbps:.2f} GB/s; "
            f"every write done at {self.data_seconds:.3f} s); "
            f"{self.groups} groups in {self.slots} slots; loading {self.loading_seconds:.3f} s, writing "
            f"{self.writing_seconds:.3f} s, waiting {self.waiting_seconds:.3f} s, staging {self.staging_seconds:.3f} s",
            f"  sender CPU {self.cpu_seconds:.3f} s" + (f" (the update's thread {self.caller_cpu_seconds:.3f} s, "
                                                       f"other threads {self.cpu_seconds - self.caller_cpu_seconds:.3f} s)"
                                                       if self.caller_cpu_seconds is not None else ""),
        ]
        lines.append(f"  sender memory {format_size(self.memory_bytes)}: slots {format_size(self.slot_bytes)}"
                     + (f" ({self.slot_location})" if self.slot_location else "")
                     + f", incomplete groups at most {format_size(self.staged_peak_bytes)}, bases "
                     f"{format_size(self.base_bytes)}")
        if self.base_bytes or self.bytes_written != self.bytes:
            deltas = sum(e.delta for e in self.engines)
            lines.append(f"  deltas: {format_size(self.bytes_written)} written for {format_size(self.bytes)} "
                         f"({self.bytes_written / max(self.bytes, 1):.1%}); {deltas} of {len(self.engines)} engine "
                         f"rank(s) took deltas; the sender's bases hold {format_size(self.base_bytes)}"
                         + (f"; {self.compared_from_inputs} parameter(s) compared from the trainer's tensors"
                            if self.compared_from_inputs else "")
                         + (f"; {self.segments_applied_beside} segment(s) applied beside the writes in "
                            f"{self.apply_calls_beside} call(s), {self.apply_beside_seconds:.3f} s"
                            if self.apply_calls_beside else ""))
        if self.replayed_groups or self.recorded_plans or self.plan_bytes or self.background_plans:
            lines.append(f"  copy plans: {self.replayed_groups} groups replayed, {self.loader_groups} by the loaders, "
                         f"{self.recorded_plans} recorded, {self.background_plans} in the background; "
                         f"plans hold {format_size(self.plan_bytes)}")
        for e in self.engines:
            lines.append(f"  {e.engine} rank {e.rank}: {format_size(e.bytes)} {e.seconds:.3f} s {e.gbps:.2f} GB/s {e.state}"
                         + (f" ({e.error})" if e.error else "")
                         + (f"; delta: {format_size(e.bytes_written)} written" if e.delta else
                            f"; full: {e.delta_reason}" if e.delta_reason and self.base_bytes else ""))
        for name, why in self.engines_skipped.items():
            lines.append(f"  {name}: skipped ({why})")
        return "\n".join(lines)


class Progress:
    """Progress lines on stderr for long work (connect of many engine ranks): the first after
    ``after`` seconds, then at most one every ``every`` seconds, and a last one if any was shown."""

    def __init__(self, what: str, total: int, *, after: float = 5.0, every: float = 5.0, stream: TextIO | None = None):
        self.what, self.total = what, total
        self.after, self.every = after, every
        self.stream = stream
        self._t0 = self._last = time.monotonic()
        self._shown = False

    def step(self, done: int, detail: str = "") -> None:
        now = time.monotonic()
        if now - self._t0 < self.after or (self._shown and now - self._last < self.every):
            return
        self._print(done, detail, now)

    def done(self) -> None:
        if self._shown:
            self._print(self.total, "done", time.monotonic())

    def _print(self, done: int, detail: str, now: float) -> None:
        self._shown, self._last = True, now
        stream = self.stream if self.stream is not None else sys.stderr
        print(f"p2pweights: {self.what}: {done}/{self.total} ({now - self._t0:.1f} s){' ' + detail if detail else ''}",
              file=stream, flush=True)
