"""Delta updates on the sender: the bases it keeps, the claims it makes, the records it writes.

:class:`DeltaBases` (one per sender, across updates) holds, per prepared engine rank and parameter,
the engine-format bytes last written (the base), and per engine the identity its last commit
answered (deltas/committed.py). :class:`UpdateDeltas` (one per update):

1. ``claim``: every engine whose ranks publish a delta area and whose identity this sender holds
   is asked, in its begin body, to accept deltas against that identity; the identity is dropped
   now (only a successful commit gives a new one), so a failed update leaves the next one full.
2. ``opened``: each engine's answer decides, per target engine rank, delta or full (the reason
   is reported: ``report.delta_reason``).
3. ``slot_rows``: for each parameter loaded into a host slot, the codec compares the slot's bytes
   with the base and updates the base on the way (deltas/codec.py). A delta target gets the record
   (prefix + record, deltas/area.py) written from the slot's spare bytes into its delta area; a
   full target, an EMPTY record's nothing, a DENSE record or one that does not fit the spare or the
   area gets the parameter's usual write. A GPU slot's targets get index records instead (below). A
   parameter written without a base update (a staged slot in a delta=False update) drops its base:
   the next update writes it in full. A rank whose every target takes deltas (``fusable``) may leave
   its replayed groups unrun (copyplans.DeferredReplay): each parameter is compared with its base
   straight from the trainer's tensors through the copy program (``_native.delta_encode_program``:
   the same record and base, the slot never written), and its slot bytes are made only where a
   usual write needs them (a DENSE record, one that does not fit, no base yet).
4. ``manifests`` go into each delta engine's end body; ``committed`` keeps the identities the end
   answers.

A group's sender 0 claims and ends for every sender: the others follow its word (``follow``,
``follow_commit``) and hand it their manifests (``written``). The PP stages of a group write the same
engine ranks: each stage writes its own part of every area (deltas/area.py ``writer_part``), and
the end names one segment per stage for such a rank. A GPU slot's index records are counted
as each rank's loaders finish and gathered when the slot closes (``slot_records``): one wait for the
device per slot. A staged slot (GPU tensors into a host slot, sender/fillers.py) is compared at its
close too, once its last copy to the host landed: one wait per slot, then the host slot's path.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from .. import _native, settings
from ..deltas import index_records, kernels
from ..deltas.area import PREFIX, Manifest, record_span, segments_wire
from ..deltas.committed import BASE_KEY, DELTA_KEY
from ..errors import raise_for_status
from .delta_bases import DeltaBases
from .delta_targets import FIRST, DeltaTarget, full_row, gpu_areas
from .fillers import HostSlotFiller

#: a rank whose compared bytes changed in more than DENSE_SHARE of them, once DENSE_AFTER of its bytes
#: were compared in an update, writes the rest of that update in full without comparing (a fresh
#: checkpoint: its records would be dense anyway); its bases still move on, so the next update can
#: take deltas. A third: where a BF16 index record stops beating the parameters' own bytes.
DENSE_SHARE = 1 / 3
DENSE_AFTER = 64 << 20
#: why an engine rank that accepted deltas was written in full: in the sender's last update (delta=False)
#: host slots filled from GPU tensors (sender/gpu_staging.py) kept no base, so their copies overlapped the loaders
STAGED = ("the last update (delta=False) filled host slots from GPU tensors and kept no base of what they held: "
          "those parameters are written in full, their bases kept again from this update on")
#: host slots write index records too (the tests run the GPU slots' format and checks on the CPU)
INDEX_RECORDS_ON_HOST = False


class UpdateDeltas:
    """One update's delta decisions and records (see the module)."""

    def __init__(self, bases: DeltaBases, ranks: Sequence[Any], buffers: Any, *, wanted: bool, off_reason: str = "",
                 keep: bool = True, writer: int = 0, writers: int = 1):
        self.bases = bases
        self.wanted = wanted  # False: delta=False (a staged slot keeps no base then: no wait for its copies)
        self.keep = keep  # keep the bases (False: this sender cannot use them; they are dropped)
        if not keep:
            bases.clear()
        self.ranks = list(ranks)
        self.buffers = buffers
        # writer of writers: this sender's part of every target's area (the PP stages of a group each write one)
        self.targets = {t.name: DeltaTarget(t, writer, writers) for p in self.ranks for t in p.targets}
        self.off_reason = off_reason or ("" if wanted else "delta=False for this update")
        for x in self.targets.values():  # reported as is when no claim is made (control=False)
            x.reason = self.off_reason or FIRST
        self.encoded = 0  # bytes of records written (prefixes included), all targets
        self.changed = 0  # bytes found changed
        self.from_inputs = 0  # parameters compared straight from the trainer's tensors (their slot bytes unmade)
        self.full_bytes: dict[str, int] = {name: 0 for name in self.targets}  # what a full update writes
        self.applied = False  # apply_now ran: the ends carry no manifests
        self._claimed: list[Any] = []  # the engines claim() set a begin body for
        self._slot: int | None = None
        self._spare_array: np.ndarray | None = None
        self._spare_t: Any = None  # the open GPU slot's spare (index records)
        self._spare_used = 0
        self._staged: list[tuple[Any, Sequence, Any]] = []  # the open staged slot's (rank, entries, filler)
        self._scratch = np.empty(0, dtype=np.uint8)
        # the open GPU slot's records, counted on the device, gathered at its close (slot_records)
        self._counted: list[tuple[Any, int, list, list, Any]] = []
        self._seen: dict[tuple[str, int], list[int]] = {}  # rank -> [bytes compared, bytes changed], this update

    # -- control ---------------------------------------------------------------------------------
    def claim(self, engines: Sequence[Any]) -> None:
        """Set each engine's begin body: a claim where it can take deltas (see the module)."""
        self._claimed = list(engines)
        for e in engines:
            identity = self.bases.identities.pop(e.name, None)
            ranks = [x for x in self.targets.values() if x.t.engine.name == e.name]
            why = self.off_reason or ("" if identity else FIRST)
            if not why and any(x.area is None for x in ranks):
                why = "its ranks publish no delta area (sglang's own server)"
            e.begin_extra = {DELTA_KEY: identity} if not why else {}
            e.begin_claim, e.begin_answer = (identity if not why else None), {}
            for x in ranks:
                x.reason = why

    def opened(self, answers: Mapping[str, Any]) -> None:
        """Each engine's begin answer decides its ranks' writes. Every claimed engine's answer is kept,
        those this sender writes no rank of included: the group's other senders follow it (:meth:`said`)."""
        for e in self._claimed:
            e.begin_extra = {}
            if e.begin_claim is None:
                continue
            answer = answers.get(e.name)
            said = answer.get(DELTA_KEY) if isinstance(answer, dict) else None
            e.begin_answer = said if isinstance(said, dict) else {}
        for x in self.targets.values():
            if x.reason:
                continue
            said = x.t.engine.begin_answer
            if said.get("accepted") is True:
                x.delta = True
            else:
                x.reason = "the engine refused the base: " + (str(said.get("reason")) if said
                                                              else "it answered no delta decision")

    # -- a group of senders: sender 0 opens and ends; every sender writes its own engine ranks ------
    def said(self, engines: Sequence[Any]) -> dict:
        """Sender 0's word at the opened step: each engine's answer and the identity it claimed."""
        return {e.name: {"claimed": e.begin_claim, "answer": e.begin_answer} for e in engines}

    def follow(self, said: Mapping[str, Any]) -> None:
        """Another sender (not sender 0): its ranks take deltas where the engine accepted sender 0's
        claim and that claim is the identity this sender holds too (its bases are that commit's)."""
        for name, word in said.items():
            mine = self.bases.identities.pop(name, None)
            for x in (x for x in self.targets.values() if x.t.engine.name == name):
                answer = word.get("answer") or {}
                if self.off_reason or mine is None or mine != word.get("claimed"):
                    x.reason = self.off_reason or (FIRST if mine is None else "sender 0 claimed another commit")
                elif answer.get("accepted") is True:
                    x.delta, x.reason = True, ""
                else:
                    x.reason = "the engine refused the base: " + (str(answer.get("reason")) if answer
                                                                  else "it answered no delta decision")

    def written(self) -> dict:
        """This sender's manifests not applied yet, ``{engine: {rank: [segment, ...]}}`` (every sender's
        go to sender 0)."""
        out: dict[str, dict] = {}
        for x in self.targets.values():
            if x.delta and (segments := x.rest()):
                out.setdefault(x.t.engine.name, {})[str(x.t.rank)] = [m.manifest().to_dict() for m in segments]
        return out

    def apply_now(self, engines: Sequence[Any], every: Sequence[Mapping[str, dict]] = ()) -> None:
        """verify=True: each delta engine applies its deltas now, before the digests (``every``: the
        group's other senders' manifests)."""
        self.manifests(engines, every)
        for e in engines:
            extra, e.end_extra = e.end_extra, {}
            if extra:
                e.p2pw_apply_deltas(extra[DELTA_KEY])
        self.applied = True

    def manifests(self, engines: Sequence[Any], every: Sequence[Mapping[str, dict]] = ()) -> None:
        """Set each delta engine's end body: what every sender wrote into each rank's area."""
        if self.applied:
            return
        merged: dict[str, dict[str, list]] = {}
        for word in (self.written(), *every):
            for engine, ranks in word.items():
                for rank, manifests in ranks.items():  # a rank several senders wrote: their segments
                    for manifest in manifests if isinstance(manifests, list) else [manifests]:
                        merged.setdefault(engine, {}).setdefault(rank, []).append(Manifest.parse(manifest, engine))
        for e in engines:
            ranks = merged.get(e.name)
            e.end_extra = {DELTA_KEY: {r: segments_wire(ms) for r, ms in ranks.items()}} if ranks else {}

    def committed(self, engines: Sequence[Any], answers: Mapping[str, Any], ok: bool) -> dict:
        """After the commit (``answers``: each engine's end answer): keep the identities it gave;
        they are returned for the group's other senders (:meth:`follow_commit`)."""
        for e in engines:
            e.end_extra = {}
            answer = answers.get(e.name)
            base = answer.get(BASE_KEY) if isinstance(answer, dict) else None
            if ok and isinstance(base, dict) and isinstance(base.get("token"), str):
                self.bases.identities[e.name] = {"epoch": base.get("epoch"), "token": base["token"]}
        return {e.name: self.bases.identities[e.name] for e in engines if e.name in self.bases.identities}

    def follow_commit(self, identities: Mapping[str, dict], ok: bool) -> None:
        """Another sender: sender 0's commit is this sender's too (its writes were in it)."""
        if ok and self.keep:  # its bases followed its writes, deltas or not (delta=False, verify in a group)
            self.bases.identities.update(identities)

    # -- data ------------------------------------------------------------------------------------
    def new_slot(self) -> None:
        self._slot, self._spare_used, self._counted, self._staged = None, 0, [], []

    def fusable(self, p: Any, filler: Any) -> bool:
        """Whether rank ``p``'s replayed groups in this slot may be compared from their inputs
        (``slot_rows``' ``replay``): a host slot filled on the host, records to host areas, every
        target taking deltas, its bases kept, not written in full for the rest of the update, and a
        replica that post-processes nothing (draft roles, vLLM's or sglang's replayed transforms)."""
        targets = [self.targets[t.name] for t in p.targets]
        replica = p.replica
        return (type(filler) is HostSlotFiller and self.keep and self.wanted and self.buffers.device == "cpu"
                and not INDEX_RECORDS_ON_HOST and not gpu_areas(p) and all(x.delta and x.area for x in targets)
                and (p.layout_key, p.rank) not in self.bases.unkept and not self._dense(p)
                and not hasattr(replica, "roles") and not getattr(replica, "replay", None))

    def slot_rows(self, p: Any, entries: Sequence[tuple[str, int, int]], filler: Any, replay: Any = None) -> list:
        """Writer rows for one prepared rank's parameters in the open slot (see the module). A staged
        slot's bytes reach its host slot by copies still in flight: its rows come at its close (slot_records).
        ``replay``: the rank's replayed groups not run into the slot (copyplans.DeferredReplay; only
        where :meth:`fusable`)."""
        # a base only where a target can take deltas (an sglang server's ranks publish no area: no copy)
        kept = self.keep and any(self.targets[t.name].area for t in p.targets)
        if kept and not isinstance(filler, HostSlotFiller):  # staged: compared once its copies landed
            if self.wanted:
                self._staged.append((p, entries, filler))
                return []
            kept = False  # delta=False: no wait for the copies, no base (the next update writes in full)
            self.bases.unkept.add((p.layout_key, p.rank))
        return self._rows(p, entries, filler.slot, kept, replay)

    def _rows(self, p: Any, entries: Sequence[tuple[str, int, int]], slot_index: int, kept: bool,
              replay: Any = None) -> list:
        full = {id(x.t) for x in self.targets.values() if not x.delta}
        rows: list = []
        # a host slot writes codec records, which only a host area takes; to a GPU area, index records
        host = kept and self.buffers.device == "cpu" and not INDEX_RECORDS_ON_HOST and not gpu_areas(p)
        if replay is not None and not host:  # (not fusable) every byte in the slot, as a replay writes them
            for _, offset, nbytes in entries:
                replay.run(offset, nbytes)
            replay = None
        if kept and self.wanted and (p.layout_key, p.rank) in self.bases.unkept:  # bases gone with a delta=False
            self.bases.unkept.discard((p.layout_key, p.rank))
            for x in (self.targets[t.name] for t in p.targets if self.targets[t.name].delta):
                x.written_full = STAGED
        if kept and not host:  # a GPU slot (or a host one with GPU areas): index records, built on its device
            return self._index_rows(p, entries, slot_index)
        if not host:
            for param, _, _ in entries:  # written without a base update: no delta against it next time
                self.bases.arrays.pop((p.layout_key, p.rank, param), None)
            # a delta target stays one: the records already in its area must be named at the end
            full = {id(t) for t in p.targets}
        slot = self.buffers.slot_array(slot_index) if host else None
        if host:
            self.bind(slot_index)
        for param, offset, nbytes in entries:
            for t in p.targets:
                self.full_bytes[t.name] += nbytes
            writes = [self.targets[t.name] for t in p.targets if id(t) not in full]
            if slot is None:
                rows += [full_row(t, param, offset, nbytes) for t in p.targets]
                continue
            rows += self._param_rows(p, param, slot, offset, nbytes, writes, full, replay)
        return rows

    def _param_rows(self, p: Any, param: str, slot: np.ndarray, offset: int, nbytes: int, writes: list,
                    full: set, replay: Any = None) -> list:
        key = (p.layout_key, p.rank, param)
        cur = slot[offset:offset + nbytes]
        base = self.bases.arrays.get(key)
        targets = p.targets
        rows = [full_row(t, param, offset, nbytes) for t in targets if id(t) in full]
        # replay: compared from the inputs where a record may come of it; the slot's bytes made for any usual write
        fused = (replay is not None and not rows and writes and base is not None and base.nbytes == nbytes
                 and not self._dense(p))
        if replay is not None and not fused:
            replay.run(offset, nbytes)
        if base is None or base.nbytes != nbytes:
            buffer, offsets = self.bases.rank_base(p, "cpu")
            base = self.bases.arrays[key] = buffer[offsets[param]:offsets[param] + nbytes]
            np.copyto(base, cur)
            return rows + [full_row(x.t, param, offset, nbytes) for x in writes]
        if not writes or self._dense(p):
            np.copyto(base, cur)
            return rows + [full_row(x.t, param, offset, nbytes) for x in writes]
        unit = targets[0].publication.params[param].element_size
        rec, n, mode, changed, in_slot = self._encode(cur, base, unit if unit in (1, 2, 4, 8) else 1, nbytes,
                                                      replay if fused else None, offset)
        self.changed += changed
        self._saw(p, nbytes, changed)
        if mode == "empty":
            return rows
        for x in writes:
            span = record_span(n)
            if (rec is None or mode == "dense" or x.cursor + span > x.end
                    or self._spare_used + PREFIX.size > self._spare_view().nbytes):
                if not in_slot:
                    replay.run(offset, nbytes)
                    in_slot = True
                rows.append(full_row(x.t, param, offset, nbytes))
                continue
            at = self._spare(PREFIX.size)
            dest = x.t.publication.target(param, nbytes, x.t.name).data_ptr
            prefix = PREFIX.pack(dest, n)
            self._spare_view()[at:at + PREFIX.size] = np.frombuffer(prefix, dtype=np.uint8)
            remote = x.area[0] + x.cursor
            rows += [(self._spare_offset(at), PREFIX.size, x.t.writer_id, remote),
                     (self._spare_offset(rec), span - PREFIX.size, x.t.writer_id, remote + PREFIX.size)]
            x.add(span, prefix, body=self._spare_view()[rec:rec + span - PREFIX.size])
            self.encoded += span
        return rows

    def _index_rows(self, p: Any, entries: Sequence[tuple[str, int, int]], slot_index: int) -> list:
        """A GPU slot's rows (index_records.py): per unit size, one record of what changed in the
        parameters ``entries`` of rank ``p`` hold, its payload written once into the slot's spare
        and its header and table once per delta target. The bases are one GPU tensor per rank."""
        slot = self.buffers.slot_tensor(slot_index)
        if self._slot != slot_index:
            self._slot, self._spare_used = slot_index, 0
            self._spare_t = self.buffers.spare_tensor(slot_index)
        base, offsets = self.bases.rank_base(p, slot.device)
        deltas = [self.targets[t.name] for t in p.targets if self.targets[t.name].delta]
        rows = [full_row(t, param, o, n) for param, o, n in entries for t in p.targets
                if not self.targets[t.name].delta]
        by_unit: dict[int, list] = {}
        copies = []  # bases moved on in full: one copy program for all of them
        dense = self._dense(p)
        for param, o, n in entries:
            for t in p.targets:
                self.full_bytes[t.name] += n
            key, at = (p.layout_key, p.rank, param), offsets.get(param)
            unit = p.targets[0].publication.params[param].element_size
            unit = unit if unit in index_records.UNITS and o % unit == 0 and n % unit == 0 else 1
            if key not in self.bases.arrays or not deltas or dense:  # no base yet, nobody takes deltas, or dense
                copies.append((o, at, n))
                self.bases.arrays[key] = base[at:at + n]
                rows += [full_row(x.t, param, o, n) for x in deltas]
            else:
                by_unit.setdefault(unit, []).append((param, o, n, at))
        kernels.copy_spans(slot, base, copies)
        for unit, params in by_unit.items():  # counted now, gathered with the slot's other records
            counting = index_records.count_changes(slot, base, [(o, at, n) for _, o, n, at in params], unit)
            self._counted.append((p, unit, params, deltas, counting))
        return rows

    def slot_records(self) -> list:
        """The open slot's rows left for its close. A staged slot: one wait until its last copy to the
        host landed, then each rank's rows as a host slot's. A GPU slot: its index records, every
        rank's: all their counts read in one wait for the device, then each gathered into the spare
        and given its rows, in the order counted."""
        import torch

        staged, self._staged = self._staged, []
        if staged:
            staged[-1][2].landed()  # every copy into the host slot, not only the last batch's
        rows: list = []
        for p, entries, filler in staged:
            rows += self._rows(p, entries, filler.slot, True)
        counted, self._counted = self._counted, []
        heads: list[tuple[int, bytes]] = []  # (spare offset, prefix + header + table) per delta target
        for (p, unit, params, deltas, counting), total in zip(counted, index_records.read_counts(
                [c for *_, c in counted])):
            rows += self._index_record(p, unit, params, deltas, counting, total, heads)
        if heads:  # one pinned buffer: a copy from pageable memory may wait for the stream
            host = torch.frombuffer(bytearray(b"".join(h for _, h in heads)), dtype=torch.uint8)
            host = host.pin_memory() if self._spare_t.is_cuda else host
            at = 0
            for hat, head in heads:
                self._spare_t[hat:hat + len(head)].copy_(host[at:at + len(head)], non_blocking=True)
                at += len(head)
        return rows

    def _index_record(self, p: Any, unit: int, params: list, deltas: list, counting: Any, total: int,
                      head_copies: list) -> list:
        full = sum(n for _, _, n, _ in params)
        heads = PREFIX.size + index_records.record_bytes(len(params), 0, unit)
        room = (self._spare_t.numel() - self._spare_used - heads * len(deltas)) // (4 + unit) - 2
        limit = min((full - heads) // (4 + unit), room)  # more changes: the usual writes (dense, or no room)
        placed: list[int] = []

        def into(count: int) -> Any:  # the payload's place in the spare: gathered there, no copy after
            n = index_records.payload_bytes(count, unit)
            placed.append(self._spare(n))
            return self._spare_t[placed[0]:placed[0] + n]

        found = index_records.gather_changes(counting, total, limit, into)
        self.changed += found.count * unit
        self._saw(p, full, found.count * unit)
        if not found.count:
            return []
        if found.positions is None:
            return [full_row(x.t, param, o, n) for param, o, n, _ in params for x in deltas]
        nrec = index_records.record_bytes(len(params), found.count, unit)
        payload = index_records.payload_bytes(found.count, unit)
        at = placed[0] if placed else self._spare(payload)
        check = index_records.write_payload(found, self._spare_t[at:at + payload])
        rows = []
        for x in deltas:
            if x.cursor + PREFIX.size + nrec > x.end:
                rows += [full_row(x.t, param, o, n) for param, o, n, _ in params]
                continue
            table, pos = [], 0
            for param, _, n, _ in params:
                table.append((pos, n // unit, x.t.publication.target(param, n, x.t.name).data_ptr))
                pos += n // unit
            head = PREFIX.pack(0, nrec) + index_records.header_and_table(found, table)
            hat = self._spare(len(head))
            head_copies.append((hat, head))  # copied with the slot's other heads (slot_records)
            remote = x.area[0] + x.cursor
            rows += [(self._spare_offset(hat), len(head), x.t.writer_id, remote),
                     (self._spare_offset(at), payload, x.t.writer_id, remote + len(head))]
            x.add(PREFIX.size + nrec, head, check=check)
            self.encoded += PREFIX.size + nrec
        return rows

    def _encode(self, cur: np.ndarray, base: np.ndarray, unit: int, nbytes: int, replay: Any = None,
                offset: int = 0) -> tuple[int | None, int, str, int, bool]:
        """Encode into the slot's spare (padded to 8 bytes) where the worst case fits, else into a
        scratch array and then copied when the record fits: (spare offset or None, bytes, mode, changed,
        whether the slot holds the bytes). ``replay``: compared from its inputs (slot bytes [offset,
        offset + nbytes) unmade), or where it leaves a byte of them unwritten run and compared in the slot."""
        need = int(_native.delta_max_encoded(nbytes))
        room = self._spare_view().nbytes - self._spare_used
        direct = need + 8 <= room
        if not direct and self._scratch.nbytes < need:
            self._scratch = np.empty(need, dtype=np.uint8)
        out = self._spare_view()[self._spare_used:self._spare_used + need] if direct else self._scratch[:need]
        threads = settings.value("P2PW_COPY_THREADS")  # the compare: as many threads as the copies
        got = replay.encode(offset, nbytes, base, unit, out, threads) if replay is not None else None
        in_slot = got is None
        if got is not None:
            self.from_inputs += 1
            n, changed, _runs, mode = got
        else:
            if replay is not None:
                replay.run(offset, nbytes)
            code, message, n, changed, _runs, mode = _native.delta_encode(
                int(cur.ctypes.data), int(base.ctypes.data), nbytes, unit, int(out.ctypes.data), need, True, threads)
            if code != int(_native.Code.OK):
                raise_for_status(code, f"delta encode: {message}")
        padded = record_span(n) - PREFIX.size
        if mode != "runs" or padded > room:
            return None, n, mode, changed, in_slot
        at = self._spare(padded)
        view = self._spare_view()
        if not direct:
            view[at:at + n] = self._scratch[:n]
        view[at + n:at + padded] = 0
        return at, n, mode, changed, in_slot

    def _saw(self, p: Any, compared: int, changed: int) -> None:
        seen = self._seen.setdefault((p.layout_key, p.rank), [0, 0])
        seen[0] += compared
        seen[1] += changed

    def _dense(self, p: Any) -> bool:
        """Whether rank ``p`` writes the rest of this update in full (DENSE_SHARE)."""
        seen = self._seen.get((p.layout_key, p.rank))
        return seen is not None and seen[0] >= DENSE_AFTER and seen[1] > DENSE_SHARE * seen[0]

    def _spare_view(self) -> np.ndarray:
        assert self._spare_array is not None  # bind() came first
        return self._spare_array

    def bind(self, slot: int) -> None:
        """The open slot (its spare holds this slot's records)."""
        if self._slot != slot:
            self._slot, self._spare_used = slot, 0
            self._spare_array = self.buffers.spare_array(slot)  # one view per slot, not one per parameter

    def _spare(self, n: int) -> int:
        at = self._spare_used
        self._spare_used += -(-n // 8) * 8
        return at

    def _spare_offset(self, at: int) -> int:
        return self.buffers.slot_bytes + at

    # -- the report ------------------------------------------------------------------------------
    def reasons(self) -> dict[str, str]:
        return {name: (x.written_full if x.delta else x.reason) for name, x in self.targets.items()}
