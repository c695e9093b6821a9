"""One target engine rank's delta state in one update (:class:`DeltaTarget`), and the two rules
:mod:`.delta_writes` asks of a rank: whether its delta areas lie on a GPU, and its usual full write."""
from __future__ import annotations

import hashlib
from typing import Any

from ..deltas import index_records
from ..deltas.area import MAX_SEGMENTS, Manifest, writer_part

FIRST = "the first update after connect writes in full"


def gpu_areas(p: Any) -> bool:
    """Whether some engine rank of ``p`` keeps its delta area on a GPU: an area lies beside its rank's
    weights (deltas/area.py), and a rank publishes where those are (``device_arch``: "cpu" for host
    memory; none from a host that publishes no build, whose areas are in host memory)."""
    return any(t.publication.delta_area and t.publication.device_arch not in ("", "cpu") for t in p.targets)


class Segment:
    """Records one writer wrote one after another into one rank's area: one manifest's worth. Its digest
    is made when it is sent (:meth:`manifest`), after its writes returned: the index records'
    checksums (device scalars) are read then, long after the device made them."""

    def __init__(self, start: int):
        self.start = self.end = start
        self.records = 0
        self.hash = hashlib.sha256()
        self.checks: list = []  # index records' payload checksums (device scalars), in the area's order
        self.offsets: list[int] = []  # each record's first byte in the area (the manifest names them)
        # the transfer slots whose writes carried its records, each with whether that use of it reached
        # the writer yet (a segment spans several slots when sealing was capped)
        self.slots: dict[int, bool] = {}

    def returned(self, done: Any) -> bool:
        """Every write of its records returned: each of its slots reached the writer and ``done(slot)``."""
        return bool(self.slots) and all(submitted and done(slot) for slot, submitted in self.slots.items())

    def manifest(self) -> Manifest:
        """The owner's word on these records: the digest ends with the index records' checksums."""
        digest = self.hash.copy()
        digest.update(index_records.checksum_words(self.checks))
        return Manifest(self.end - self.start, self.records, digest.hexdigest(), tuple(self.offsets), self.start)


class DeltaTarget:
    """One target engine rank's delta state in one update: its records as segments, sealed one per
    slot when the sender applies them beside its writes (sender/apply_beside.py), else one."""

    def __init__(self, t: Any, writer: int = 0, writers: int = 1):
        self.t = t
        self.delta = False
        self.reason = FIRST
        self.area = t.publication.delta_area
        # this sender's part of the area: a rank's writers (PP stages) each write their own (area.writer_part)
        self.start, self.end = writer_part(self.area[1], writer, writers) if self.area else (0, 0)
        # sealed segments waiting at most: every writer's rest still fits one end (area.MAX_SEGMENTS)
        self.most_sealed = MAX_SEGMENTS // writers - 1
        self.records = 0  # in this update, all segments
        self.open = Segment(self.start)  # the records being written
        self.sealed: list[Segment] = []  # written, not yet sent to the engine
        self.sent = 0  # segments applied beside the writes
        self.written_full = ""  # why its claim was accepted yet its parameters went in full (the report says it)

    @property
    def cursor(self) -> int:
        """Where this target's next record goes in the area."""
        return self.open.end

    def add(self, span: int, head: bytes, body: Any = None, check: Any = None) -> None:
        """One record of ``span`` bytes at the cursor: its prefix (and header and table) ``head``, then
        a codec record's bytes ``body`` hashed too, or an index record's payload checksum ``check``."""
        seg = self.open
        seg.hash.update(head)
        if body is not None:
            seg.hash.update(body)
        if check is not None:
            seg.checks.append(check)
        seg.offsets.append(seg.end)
        seg.end += span
        seg.records += 1
        self.records += 1

    def seal(self, slot: int, most: int) -> None:
        """Transfer slot ``slot`` closed, holding the open segment's last records: sealed (at most
        ``most`` sealed waiting; past that the open one grows on, so an end never names too many)."""
        if not self.open.records:
            return
        self.open.slots[slot] = False  # this use of the slot: not handed to the writer yet
        if len(self.sealed) < min(most, self.most_sealed):
            seg, self.open = self.open, Segment(self.open.end)
            self.sealed.append(seg)

    def submitted(self, slot: int) -> None:
        """Transfer slot ``slot`` reached the writer: its segments' use of it is submitted."""
        for seg in (*self.sealed, self.open):
            if seg.slots.get(slot) is False:
                seg.slots[slot] = True

    def take(self, done: Any) -> list[Segment]:
        """The sealed segments, oldest first, whose writes all returned (``done(slot)``)."""
        k = 0
        while k < len(self.sealed) and self.sealed[k].returned(done):
            k += 1
        out, self.sealed = self.sealed[:k], self.sealed[k:]
        self.sent += len(out)
        return out

    def rest(self) -> list[Segment]:
        """Every segment not sent yet (sealed, then the open one): what the end names (an empty one when
        nothing was written nor sent: the end still says so)."""
        return [*self.sealed, *([self.open] if self.open.records or not (self.sealed or self.sent) else [])]


def full_row(t: Any, param: str, offset: int, nbytes: int) -> tuple[int, int, int, int]:
    """The parameter's usual write to target ``t`` (its bytes checked against the target's table)."""
    return offset, nbytes, t.writer_id, t.publication.target(param, nbytes, t.name).data_ptr
