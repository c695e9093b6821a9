"""An engine rank's delta area: where senders write encoded deltas one-sided, and where the rank
applies them at the end of the session (before post-processing).

Every host of an engine rank (our receiver, the sglang plugin, the vLLM backend) keeps one
:class:`DeltaArea` next to its weights, registers it with the same revocable endpoint
(transport/revocation.py: a takeover revokes it with the weights) and publishes it
(``EnginePublication.delta_area``). The area holds records one after another, each::

    dest (u64, the engine address of the parameter's first byte; 0 for an index record) | nbytes
    (u64, the record's bytes) | the record | zero padding to 8 bytes

A record is a codec record (deltas/codec.py: a host slot's varint runs; host areas only) or an index
record (deltas/index_records.py: a GPU slot's changed positions and values; any area, checked and
applied on the device of the weights: index_apply.py). A rank whose weights are on a GPU keeps its
area in GPU memory.

The session's owner names, in its end call, how many bytes and records it wrote, where each record
begins and the SHA-256 of what it wrote (:class:`Manifest`): every codec record's bytes, every
index record's prefix, header and table, then every index record's payload checksum (computed on
the device; index_records.py). Several writers of one rank (the senders of several PP stages) each
write their own part of the area (:func:`writer_part`) and name it in their own manifest, a
*segment* (:func:`parse_segments`: ascending and disjoint). :meth:`DeltaArea.apply` refuses the
whole area unless in every segment the offsets chain exactly (each the previous one plus its
record's span, the last ending at the segment's end), the bytes are exactly those, every record
passes its checks and every destination lies inside the rank's weight regions — before the first
byte of any segment is applied. Knowing every offset, a GPU area reads every record's prefix,
header and table from the device in one copy, and every payload's device checks in one more: the
waits per end do not grow with the records. A refused apply fails the end: the engine is torn, as
after any failed update (docs/deltas.md).
"""
from __future__ import annotations

import hashlib
import logging
import mmap
import struct
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .. import _native
from ..errors import InvalidWrite, OutOfRegion, raise_for_status
from ..settings import value as setting
from . import index_apply, index_records
from .codec import HEADER, HEADER_BYTES

#: a record's prefix: destination address, codec record bytes
PREFIX = struct.Struct("<QQ")
ALIGN = 8
#: segments (writers) one rank's manifest may name: a bound on the work an end body can ask for
MAX_SEGMENTS = 1024
_WINDOW = 4 << 10  # bytes of a GPU area read per record at first: the prefix, header and a table of 168 rows


def record_span(nbytes: int) -> int:
    """Bytes one record of an ``nbytes`` codec record takes in the area (prefix and padding)."""
    return PREFIX.size + -(-int(nbytes) // ALIGN) * ALIGN


@dataclass(frozen=True)
class Manifest:
    """What the owner wrote into one rank's area in this session (sent in its end call)."""

    bytes: int
    records: int
    sha256: str
    #: each record's first byte in the area, ascending (None: the owner sent none; the rank walks the
    #: records, one read per record from a GPU area's device)
    offsets: tuple[int, ...] | None = None
    #: the segment's first byte in the area (its writer's part, :func:`writer_part`): it holds
    #: [start, start + bytes)
    start: int = 0

    def to_dict(self) -> dict:
        d = {"bytes": self.bytes, "records": self.records, "sha256": self.sha256}
        if self.offsets is not None:
            d["offsets"] = list(self.offsets)
        if self.start:
            d["start"] = self.start
        return d

    @classmethod
    def parse(cls, d: Any, where: str) -> "Manifest":
        """A manifest from a request body, each field type-checked (InvalidWrite names the field)."""
        if not isinstance(d, dict):
            raise InvalidWrite(f"{where}: a delta manifest must be an object, not {type(d).__name__}")
        for key in ("bytes", "records", "start"):
            v = d.get(key, 0 if key == "start" else None)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InvalidWrite(f"{where}: delta manifest field {key!r} must be an integer >= 0, got {v!r}")
        if d.get("start", 0) % ALIGN:
            raise InvalidWrite(f"{where}: delta manifest field 'start' must be a multiple of {ALIGN}")
        digest = d.get("sha256")
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise InvalidWrite(f"{where}: delta manifest field 'sha256' must be 64 lowercase hex digits")
        offsets = d.get("offsets")
        if offsets is not None and (not isinstance(offsets, list) or len(offsets) != d["records"] or any(
                not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in offsets)):
            raise InvalidWrite(f"{where}: delta manifest field 'offsets' must list an integer >= 0 for each of its "
                               f"{d['records']} records")
        return cls(int(d["bytes"]), int(d["records"]), digest, None if offsets is None else tuple(offsets),
                   int(d.get("start", 0)))


def parse_segments(d: Any, where: str) -> tuple[Manifest, ...]:
    """One rank's manifests from a request body: one manifest (one writer), or a list of them, one per
    writer, each type-checked, ascending and disjoint (InvalidWrite names the fault)."""
    if not isinstance(d, list):
        return (Manifest.parse(d, where),)
    if not 1 <= len(d) <= MAX_SEGMENTS:
        raise InvalidWrite(f"{where}: a list of delta manifests names 1 to {MAX_SEGMENTS} segments, not {len(d)}")
    segments = tuple(Manifest.parse(m, f"{where}[{k}]") for k, m in enumerate(d))
    disjoint(segments, where)
    return segments


def disjoint(segments: Sequence[Manifest], where: str) -> None:
    """InvalidWrite unless the segments ascend and none overlaps the next: two writers' records never
    share a byte of the area, so no writer's digest can vouch for another's bytes."""
    for k in range(1, len(segments)):
        prev, seg = segments[k - 1], segments[k]
        if seg.start < prev.start + prev.bytes:
            raise InvalidWrite(f"{where}: delta segment {k} begins at byte {seg.start}, inside segment {k - 1} "
                               f"[{prev.start}, {prev.start + prev.bytes})")


def segments_wire(segments: Sequence[Manifest]) -> Any:
    """What an end body says for one rank: one manifest as itself, several as a list (ascending)."""
    ordered = sorted(segments, key=lambda m: m.start)
    if len(ordered) == 1 and not ordered[0].start:
        return ordered[0].to_dict()
    return [m.to_dict() for m in ordered]


def writer_part(nbytes: int, writer: int, writers: int) -> tuple[int, int]:
    """[start, end) of an ``nbytes`` area that writer ``writer`` of ``writers`` writes its records
    into: equal parts, 8-byte aligned, the last one to the end. Every writer of a rank computes the
    same parts, so none needs the others' word before it writes."""
    if not 0 <= writer < writers:
        raise ValueError(f"writer {writer} is not in [0, {writers})")
    share = int(nbytes) // writers // ALIGN * ALIGN
    start = writer * share
    return start, (int(nbytes) if writer == writers - 1 else start + share)


class DeltaArea:
    """``nbytes`` of page-aligned memory for one engine rank's deltas: host memory, or GPU memory
    (``device="cuda:N"``) for a rank whose weights are there."""

    def __init__(self, nbytes: int, rank: int = 0, engine: str = "engine", device: str = "cpu"):
        if int(nbytes) <= 0:
            raise ValueError(f"a delta area needs > 0 bytes, got {nbytes}")
        self.nbytes = int(nbytes)
        self.rank, self.engine, self.device = int(rank), engine, device
        self._mem: mmap.mmap | None = None
        self._raw: Any = None
        if device == "cpu":
            self._mem = mmap.mmap(-1, self.nbytes)
            self.array = np.frombuffer(self._mem, dtype=np.uint8)
            self.address = int(self.array.ctypes.data)
        else:
            import torch  # a GPU area: torch holds the memory (the native core never links torch)

            self._raw = torch.zeros(self.nbytes + mmap.PAGESIZE, dtype=torch.uint8, device=device)
            skip = (-self._raw.data_ptr()) % mmap.PAGESIZE
            self.tensor = self._raw[skip:skip + self.nbytes]
            self.array = np.empty(0, dtype=np.uint8)
            self.address = int(self.tensor.data_ptr())
        self.last: dict = {}  # the last apply's figures
        self._reads = 0  # reads from a GPU area's device in the last check

    def region(self) -> tuple[int, int, str]:
        """(address, bytes, device) to register next to the weights."""
        return self.address, self.nbytes, self.device

    def published(self) -> list[int]:
        return [self.address, self.nbytes]

    def _refuse(self, cls: type, what: str) -> None:
        raise cls(f"engine {self.engine} rank {self.rank}: delta area refused, nothing applied: {what}")

    def _bytes(self, at: int, n: int) -> bytes:
        self._reads += self.device != "cpu"
        if self.device == "cpu":
            return self.array[at:at + n].tobytes()
        return self.tensor[at:at + n].cpu().numpy().tobytes()

    def _windows(self, spans: Sequence[tuple[int, int]]) -> list[memoryview]:
        """The bytes of each (start, length) of the area: a GPU area's in one copy from the device."""
        if self.device == "cpu":
            return [memoryview(self.array[a:a + n]) for a, n in spans]
        if not spans:
            return []
        import torch

        parts = [self.tensor[a:a + n] for a, n in spans]
        flat = memoryview((torch.cat(parts) if len(parts) > 1 else parts[0]).cpu().numpy().tobytes())
        self._reads += 1
        out, at = [], 0
        for _, n in spans:
            out.append(flat[at:at + n])
            at += n
        return out

    def _payload(self, at: int, n: int) -> Any:
        """``n`` bytes of the area from ``at`` as a uint8 tensor on the area's device (no copy)."""
        if self.device != "cpu":
            return self.tensor[at:at + n]
        import torch

        return torch.from_numpy(self.array[at:at + n])

    def _offsets(self, manifest: Manifest) -> list[int]:
        """Where each record begins: the manifest's offsets (checked to ascend inside its segment; that
        they chain exactly is checked against the records' prefixes), else found by walking the
        records (an owner that sends none: a GPU area then reads each prefix from the device)."""
        first, end = manifest.start, manifest.start + manifest.bytes
        if manifest.offsets is None:
            offsets, pos = [], first
            while pos < end:
                if end - pos < PREFIX.size + HEADER_BYTES:
                    self._refuse(InvalidWrite, f"a record at byte {pos} is cut short")
                n = PREFIX.unpack(self._bytes(pos, PREFIX.size))[1]
                if n < HEADER_BYTES or record_span(n) > end - pos:
                    self._refuse(InvalidWrite, f"the record at byte {pos} claims {n} bytes")
                offsets.append(pos)
                pos += record_span(n)
            return offsets
        offsets = list(manifest.offsets)
        if len(offsets) != manifest.records or (manifest.bytes and not offsets):
            self._refuse(InvalidWrite, f"the manifest names {manifest.records} records, {len(offsets)} offsets and "
                                       f"{manifest.bytes} bytes")
        for k, at in enumerate(offsets):
            if (at != first if k == 0 else at <= offsets[k - 1]) or at % ALIGN or end - at < PREFIX.size + HEADER_BYTES:
                self._refuse(InvalidWrite, f"the records' offsets do not chain: record {k} at byte {at} of the "
                                           f"segment [{first}, {end})")
        return offsets

    def check(self, manifests: Manifest | Sequence[Manifest], regions: Sequence[tuple[int, int]],
              tensors: Sequence[Any] = ()) -> tuple[list[tuple], index_apply.Checked]:
        """Every record of every segment (``manifests``: one manifest, or one per writer), checked
        (``tensors``: the weight regions as uint8 tensors, for index records): ([("runs", record
        address, bytes, dest, dest bytes) or ("index", index_apply.Record)], the index records'
        device verdicts). Raises (nothing applied) unless all of them are sound. A GPU area is read
        from the device once for every record's prefix, header and table (twice when a table
        outgrows its window), and once for every payload's verdicts: whatever the writers."""
        segments = (manifests,) if isinstance(manifests, Manifest) else tuple(manifests)
        for m in segments:
            if m.start + m.bytes > self.nbytes:
                self._refuse(OutOfRegion, f"the manifest names bytes [{m.start}, {m.start + m.bytes}); the area "
                                          f"holds {self.nbytes}")
        self._reads = 0
        flat: list[tuple[int, int, int]] = []  # (segment, record's first byte, the next one's)
        for si, m in enumerate(segments):
            offsets = self._offsets(m)
            flat += [(si, a, e) for a, e in zip(offsets, [*offsets[1:], m.start + m.bytes])]
        gpu = self.device != "cpu"
        windows = self._windows([(a, min(e - a, _WINDOW) if gpu else e - a) for _, a, e in flat])
        heads: dict[int, int] = {}  # index records: their prefix, header and table bytes
        for k, ((_, pos, end), w) in enumerate(zip(flat, windows)):
            n = PREFIX.unpack_from(w, 0)[1]
            if n < HEADER_BYTES or record_span(n) != end - pos:
                self._refuse(InvalidWrite, f"the records' offsets do not chain: the record at byte {pos} spans "
                                           f"{record_span(n)} bytes (it claims {n}), the next begins at byte {end}")
            if w[PREFIX.size:PREFIX.size + 4] == index_records.MAGIC:
                entries = index_records.HEADER.unpack_from(w, PREFIX.size)[3]
                heads[k] = min(PREFIX.size + index_records.HEADER.size + index_records.ENTRY.size * entries, end - pos)
            elif gpu:
                self._refuse(InvalidWrite, f"the record at byte {pos} is not an index record (a GPU area takes "
                                           f"no others)")
        longer = [k for k, need in heads.items() if need > len(windows[k])]  # tables past the window
        for k, w in zip(longer, self._windows([(flat[k][1], heads[k]) for k in longer])):
            windows[k] = w
        digests = [hashlib.sha256() for _ in segments]
        counts = [0] * len(segments)
        out: list[tuple] = []
        indexed: list[int] = []  # each index record's segment, in order
        for k, ((si, pos, _), w) in enumerate(zip(flat, windows)):
            dest, n = PREFIX.unpack_from(w, 0)
            counts[si] += 1
            if k in heads:
                digests[si].update(w[:heads[k]])
                out.append(("index", self._check_index(pos, n, w[:heads[k]], regions, tensors)))
                indexed.append(si)
            else:
                digests[si].update(w)
                out.append(("runs", *self._check_runs(w, pos, n, dest, regions)))
        checked = index_apply.verdicts([r[1] for r in out if r[0] == "index"], tensors)  # one read for all
        for si, check in zip(indexed, checked.checksums):  # each writer's digest ends with its records' checksums
            digests[si].update(struct.pack("<Q", check))
        for si, (m, digest) in enumerate(zip(segments, digests)):
            which = f"segment {si}: " if len(segments) > 1 else ""
            if digest.hexdigest() != m.sha256:
                self._refuse(InvalidWrite, f"{which}its bytes are not the ones the session's owner wrote (SHA-256 "
                                           f"differs)")
            if counts[si] != m.records:
                self._refuse(InvalidWrite, f"{which}the manifest names {m.records} records; the area holds "
                                           f"{counts[si]}")
        if checked.bad:
            self._refuse(InvalidWrite, f"index record {checked.bad[0]}: its positions are not ascending inside its "
                                       f"table")
        return out, checked

    def _check_runs(self, record: memoryview, pos: int, n: int, dest: int,
                    regions: Sequence[tuple[int, int]]) -> tuple[int, int, int, int]:
        rec = self.address + pos + PREFIX.size
        dst_nbytes = HEADER.unpack_from(record, PREFIX.size)[5]
        if not any(a <= dest and dest + dst_nbytes <= a + size for a, size in regions):
            self._refuse(OutOfRegion, f"the record at byte {pos} writes [{dest:#x}, +{dst_nbytes}), outside "
                                      f"this rank's weights")
        code, message = _native.delta_check(rec, n, dst_nbytes)
        if code != int(_native.Code.OK):
            raise_for_status(code, f"engine {self.engine} rank {self.rank}: delta area refused, nothing "
                                   f"applied: the record at byte {pos}: {message}")
        return rec, n, dest, dst_nbytes

    def _check_index(self, pos: int, n: int, head: memoryview, regions: Sequence[tuple[int, int]],
                     tensors: Sequence[Any]) -> index_apply.Record:
        """One index record's header and table (``head``: its prefix, header and table bytes)."""
        try:
            if len(tensors) != len(regions) or any(t.numel() * t.element_size() < size
                                                   for (_, size), t in zip(regions, tensors)):
                raise ValueError("this rank gave no tensors of its weights (as large as its regions) to apply it with")
            at = PREFIX.size + index_records.HEADER.size
            unit, count, total, rows = index_records.table_rows(bytes(head[PREFIX.size:at]), head[at:], n, regions)
        except (ValueError, struct.error) as e:
            self._refuse(InvalidWrite, f"the index record at byte {pos}: {e}")
        payload_at = pos + len(head)
        return index_apply.Record(pos, self._payload(payload_at, pos + PREFIX.size + n - payload_at), unit, count,
                                  total, rows)

    def apply(self, manifests: Manifest | Sequence[Manifest], regions: Sequence[tuple[int, int]],
              tensors: Sequence[Any] = ()) -> dict:
        """Check every record of every segment (:meth:`check`; ``manifests``: one manifest, or one per
        writer, :func:`parse_segments`), then apply them into the weights: the index records of every
        segment at once (one kernel launch, or torch), where the first of them lies."""
        segments = (manifests,) if isinstance(manifests, Manifest) else tuple(manifests)
        disjoint(segments, f"engine {self.engine} rank {self.rank}")
        t0 = time.perf_counter()
        records, checked = self.check(segments, regions, tensors)  # every segment before a byte of any
        reads = self._reads + (self.device != "cpu" and bool(checked.records))  # the verdicts: one more
        t1 = time.perf_counter()
        indexed = False
        for kind, *rest in records:
            if kind == "index":
                if not indexed:
                    index_apply.apply(checked)
                    indexed = True
                continue
            rec, n, dest, dst_nbytes = rest
            # check() walked this record and the digest covers it: one copying walk (still bounded)
            code, message = _native.delta_apply(rec, n, dest, dst_nbytes, checked=True)
            if code != int(_native.Code.OK):  # checked above: a failure here is a bug; the end fails (torn)
                raise_for_status(code, f"engine {self.engine} rank {self.rank}: applying a delta record: {message}")
        count = len(records)
        if self.device != "cpu" and count:
            import torch

            torch.cuda.synchronize(self.device)  # applied before the end's post-processing reads them
        self.last = {"records": count, "bytes": sum(m.bytes for m in segments), "segments": len(segments),
                     "check_s": round(t1 - t0, 6), "apply_s": round(time.perf_counter() - t1, 6),
                     "device_reads": reads,
                     "index_path": "kernels" if checked.device is not None else "torch"}
        return dict(self.last)

    def close(self) -> None:
        self._raw = None
        self.tensor = None
        if self._mem is not None:
            self.array = np.empty(0, dtype=np.uint8)
            try:
                self._mem.close()
            except BufferError:  # a view is still alive; the mapping goes with it
                pass
            self._mem = None


def area_bytes(weight_bytes: int, setting_value: int | None) -> int:
    """The area of a rank holding ``weight_bytes``: ``P2PW_DELTA_AREA`` when set, else an eighth of
    the weights (at least 4 MiB), rounded up to the page size."""
    n = int(setting_value) if setting_value else max(4 << 20, int(weight_bytes) // 8)
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


logger = logging.getLogger(__name__)


def open_rank_area(weight_bytes: int, device: str, rank: int, engine: str, size: int | None = None,
                   how_to_size: str = "P2PW_DELTA_AREA") -> DeltaArea | None:
    """The one placement and sizing policy of an engine rank's delta area, whatever hosts the engine
    (our receiver, the sglang plugin, the vLLM backend): beside the weights, on their ``device``.
    In host memory always: ``size``, else ``P2PW_DELTA_AREA``, else an eighth of the weights. On a GPU
    only where sized (``size`` or ``P2PW_DELTA_AREA``: the area takes memory the engine would give its
    KV cache), and only where it fits. None: no area (full writes), said with ``how_to_size``."""
    given = size or setting("P2PW_DELTA_AREA")
    if device != "cpu" and not given:
        logger.info("p2pweights: engine %s rank %d keeps its weights on %s: no delta area unless %s sizes one "
                    "(full writes)", engine, rank, device, how_to_size)
        return None
    nbytes = area_bytes(weight_bytes, given)
    try:
        return DeltaArea(nbytes, rank, engine, device=device)
    except RuntimeError as e:  # torch.OutOfMemoryError is one
        if device == "cpu":
            raise
        logger.warning("p2pweights: engine %s rank %d has no room for a %d-byte delta area on %s (%s): full writes "
                       "only; size it with %s", engine, rank, nbytes, device, e, how_to_size)
        return None

