"""The engine ranks a sender prepares and the engine ranks it writes them to."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..control import SglangEngine
from ..transport.publication import EnginePublication
from .stager import GroupStager


@dataclass
class EngineTarget:
    """One engine rank this sender writes: which engine, which writer id, what it published."""

    engine: SglangEngine
    rank: int
    writer_id: int
    publication: EnginePublication
    instance: str | None = None  # the engine process attached to (engine core's ``instance``; engine_set.py)

    @property
    def name(self) -> str:
        return f"{self.engine.name}/rank{self.rank}"


@dataclass
class PreparedRank:
    """One engine rank this sender prepares (loads once, with its shard layout's replica) and the
    engine ranks of that layout it writes those bytes to."""

    layout_key: str
    rank: int
    replica: Any  # p2pweights.replica.ModelReplica
    stager: GroupStager
    targets: list[EngineTarget] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.layout_key} rank {self.rank}"
