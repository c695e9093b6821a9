"""One target engine rank's delta state in one update (:class:`DeltaTarget`), and the two rules
:mod:`.delta_writes` asks of a rank: whether its delta areas lie on a GPU, and its usual full write."""
from __future__ import annotations

import hashlib
from typing import Any

from ..deltas import index_records
from ..deltas.area import Manifest, writer_part

FIRST = "the first update after connect writes in full"


def gpu_areas(p: Any) -> bool:
    """Whether some engine rank of ``p`` keeps its delta area on a GPU: an area lies beside its rank's
    weights (deltas/area.py), and a rank publishes where those are (``device_arch``: "cpu" for host
    memory; none from a host that publishes no build, whose areas are in host memory)."""
    return any(t.publication.delta_area and t.publication.device_arch not in ("", "cpu") for t in p.targets)


class DeltaTarget:
    """One target engine rank's delta state in one update."""

    def __init__(self, t: Any, writer: int = 0, writers: int = 1):
        self.t = t
        self.delta = False
        self.reason = FIRST
        self.area = t.publication.delta_area
        # this sender's part of the area: a rank's writers (PP stages) each write their own (area.writer_part)
        self.start, self.end = writer_part(self.area[1], writer, writers) if self.area else (0, 0)
        self.cursor = self.start
        self.records = 0
        self.hash = hashlib.sha256()
        self.checks: list = []  # index records' payload checksums (device scalars), in the area's order
        self.offsets: list[int] = []  # each record's first byte in the area (the manifest names them)
        self.written_full = ""  # why its claim was accepted yet its parameters went in full (the report says it)

    def manifest(self) -> Manifest:
        """The owner's word on this rank's area: the digest ends with the index records' checksums."""
        digest = self.hash.copy()
        digest.update(index_records.checksum_words(self.checks))
        return Manifest(self.cursor - self.start, self.records, digest.hexdigest(), tuple(self.offsets), self.start)


def full_row(t: Any, param: str, offset: int, nbytes: int) -> tuple[int, int, int, int]:
    """The parameter's usual write to target ``t`` (its bytes checked against the target's table)."""
    return offset, nbytes, t.writer_id, t.publication.target(param, nbytes, t.name).data_ptr
