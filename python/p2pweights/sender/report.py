"""What one update reports: bytes, seconds and where the time went, per update and per engine rank."""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class EngineRankReport:
    engine: str
    rank: int
    bytes: int
    seconds: float
    gbps: float
    state: str
    error: str = ""


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

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        lines = [
            f"update {self.version}: {format_size(self.bytes)} in {self.seconds:.3f} s ({self.gbps:.2f} GB/s; "
            f"every write done at {self.data_seconds:.3f} s); "
            f"{self.groups} groups in {self.slots} slots; loading {self.loading_seconds:.3f} s, writing "
            f"{self.writing_seconds:.3f} s, waiting {self.waiting_seconds:.3f} s, staging {self.staging_seconds:.3f} s"
        ]
        for e in self.engines:
            lines.append(f"  {e.engine} rank {e.rank}: {format_size(e.bytes)} {e.seconds:.3f} s {e.gbps:.2f} GB/s {e.state}"
                         + (f" ({e.error})" if e.error else ""))
        return "\n".join(lines)
