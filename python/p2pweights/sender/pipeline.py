"""The slot pipeline: complete (transformed) parameter groups → slots filled by the replica's
loaders → the writer.

Groups are placed one after another in the open slot (each at a 256-byte aligned offset). Their
loaders run later, together with the slot's other groups: one ``load_weights`` call per engine
rank per batch, because sglang's loaders pay a fixed cost per call. A batch is loaded when the
slot is full or when its HF inputs reach a slot's size (a quarter slot for staged slots, so one
batch's copy-out overlaps the next batch's loaders), each HF tensor counted once however many
engine ranks read it. The slot's filler (fillers.py) decides where the loaders write and how the
complete slot reaches the writer.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Mapping

from .. import transport as transports
from .fillers import SlotFiller, SlotHandOver
from .prepared import PreparedRank
from .report import UpdateTimes
from .transforms import GroupLoad

_ALIGN = 256  # every group starts at a multiple of this inside a slot


class SlotPipeline:
    """Fills slots with complete groups and hands them to the writer; ``drain`` at the end of an
    update, ``abort`` on failure (every slot it holds is released, after its device work landed)."""

    def __init__(self, handover: SlotHandOver, choose_filler: Callable[[Mapping[str, Any]], SlotFiller],
                 times: UpdateTimes):
        self.handover = handover
        self._choose = choose_filler
        self.times = times
        self._filler: SlotFiller | None = None  # the open slot's filler
        self._cursor = 0
        self._rows: list[tuple[int, int, int, int]] = []  # the open slot's writes, loaded so far
        self._placed: list[GroupLoad] = []  # placed in the open slot, loaders not yet run
        self._offsets: list[int] = []
        self._placed_input_bytes = 0  # each placed HF tensor once, however many engine ranks read it
        self._placed_inputs: set[int] = set()
        self.digests: Any = None  # verify=True: a sender.verify.WrittenDigests, fed every loaded parameter
        self.deltas: Any = None  # a sender.delta_writes.UpdateDeltas: the rows of delta and full targets
        self.beside: Any = None  # a sender.apply_beside.AppliesBeside: seals each closed slot's records
        # the delta compare may read replayed groups' bytes from their inputs, without the slot (no
        # transform of the update's: what a group's program copies is what the engine gets)
        self.fuse_compare = True

    @property
    def placed_input_bytes(self) -> int:
        """Bytes of the HF tensors placed in the open slot whose loaders have not run yet."""
        return self._placed_input_bytes

    def placed_tensors(self) -> list[Any]:
        return [t for load in self._placed for t in load.tensors.values()]

    def place(self, load: GroupLoad) -> None:
        """Place a complete group in the open slot (closing it first when the group does not fit)."""
        slot_bytes = self.handover.buffers.slot_bytes
        if self._filler is not None and self._cursor + load.group.nbytes > slot_bytes:
            self.close_slot()
        if self._filler is None:
            self._open(load.tensors)
        self._placed.append(load)
        self._offsets.append(self._cursor)
        for t in load.tensors.values():
            if id(t) not in self._placed_inputs:
                self._placed_inputs.add(id(t))
                self._placed_input_bytes += int(t.numel()) * t.element_size()
        self._cursor = -(-(self._cursor + load.group.nbytes) // _ALIGN) * _ALIGN
        self.times.groups += 1
        if self._placed_input_bytes >= slot_bytes // self._filler.batch_divisor:
            self._load_placed()

    def _open(self, inputs: Mapping[str, Any]) -> None:
        filler = self._choose(inputs)
        filler.open(next(iter(inputs.values())).device)
        self._filler, self._cursor = filler, 0
        if self.deltas is not None:
            self.deltas.new_slot()

    def _load_placed(self) -> None:
        """Run the loaders of every placed group (one call per prepared engine rank) and queue
        their writes to every engine rank that rank's bytes go to."""
        if not self._placed:
            return
        self.handover.poll()
        t0 = time.perf_counter()
        by_rank: dict[int, tuple[PreparedRank, list, dict]] = {}
        for load, offset in zip(self._placed, self._offsets):
            entry = by_rank.setdefault(id(load.rank), (load.rank, [], {}))
            entry[1].append((load.group, offset))
            entry[2].update(load.tensors)
        target = self._filler.target
        # a steady delta update on a host slot: replayed groups are compared from their inputs
        # (delta_writes.py), their slot bytes made only where a full write needs them
        fuse = self.fuse_compare and self.deltas is not None and self.digests is None
        loaded, later = [], {}
        for p, placed, tensors in by_rank.values():
            deferred: list | None = [] if fuse and self.deltas.fusable(p, self._filler) else None
            loaded.append((p, self._filler.produce(p, placed, tensors, deferred)))
            if deferred:
                later[id(p)] = deferred[0]
        extent = max(r.offset + r.nbytes for _, regions in loaded for r in regions)
        if self.digests is not None:  # queued after the loaders, before the slot goes to the writer
            for p, regions in loaded:
                self.digests.add(p, regions, target)
        self.times.loading += time.perf_counter() - t0
        t0 = time.perf_counter()
        for p, regions in loaded:
            entries = [(r.param_name, r.offset, r.nbytes) for r in regions]
            if self.deltas is not None:
                self._rows += self.deltas.slot_rows(p, entries, self._filler, later.get(id(p)))
                continue
            for t in p.targets:
                self._rows += transports.param_writes(t.publication, t.writer_id, t.name, entries)
        self._placed, self._offsets, self._placed_input_bytes, self._placed_inputs = [], [], 0, set()
        self.times.staging += time.perf_counter() - t0
        self._filler.loaded(extent)

    def close_slot(self) -> None:
        """Load what is placed and hand the open slot over (its filler decides how)."""
        if self._filler is None:
            return
        self._load_placed()
        if self.deltas is not None:  # every rank's index records of the slot: one wait for the device
            t0 = time.perf_counter()
            self._rows += self.deltas.slot_records()
            if self.beside is not None:  # applied once this slot's writes returned
                self.beside.seal(self._filler.slot)
            self.times.staging += time.perf_counter() - t0
        rows, self._rows = self._rows, []
        self._filler.close(rows)
        self._filler = None

    def drain(self) -> None:
        """The update's last group is placed: close the open slot, hand over the pending one."""
        self.close_slot()
        self.handover.flush()

    def abort(self) -> None:
        """Release every slot held, each after its device work landed; nothing more is written."""
        self._placed, self._offsets, self._placed_input_bytes, self._placed_inputs = [], [], 0, set()
        self._rows = []
        filler, self._filler = self._filler, None
        try:
            if filler is not None:
                filler.abort()
        finally:
            self.handover.abort()
