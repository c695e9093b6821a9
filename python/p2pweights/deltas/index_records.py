"""Index records: the delta encoding for bytes that live in GPU memory, built and applied with torch
on the device that holds them (the sender's GPU slot, the engine rank's GPU weights), one pass per
record and never a byte of payload through the host.

The host codec (codec.py: varint runs) suits a CPU that walks bytes; a GPU finds every changed
element of a slot at once (``ne`` then ``nonzero``) and applies them with one scatter. One record
covers the parameters of one unit size (2 for BF16; 1 and 4 for FP8 weights and their scales) that
one prepared rank loaded into one slot, concatenated in the order of its table::

    header  magic "P2PX" | version u16 | unit u16 | entries u32 | reserved u32 | count u64 | checksum u64
    table   entries x (position u64, elements u64, dest u64): the parameter's first element in the
            concatenation, its elements, the engine address of its first byte
    payload count x int32 positions (ascending), zero-padded to 8 | count x unit values, padded to 8

A payload's checksum is a 64-bit sum of its words, each times an odd multiplier of its position,
computed on the device on both sides (a changed word always changes it). The area's manifest
(area.py) is the SHA-256 of every record's prefix, header and table followed by every index
record's checksum, so the owner's word covers the whole record without moving its payload to a
host, and each side waits for the device once for all its checksums, not once per record. The
header's ``checksum`` field is reserved (0).

The engine rank checks every record of its area before any is applied: each header and table on
the host (:func:`table_rows`: the table inside its weights), then every payload on the device at
once (index_apply.py: positions ascending and inside the table, the checksum), then applies them
all (index_apply.py: one kernel launch for the area, or torch).
"""
from __future__ import annotations

import bisect
import struct
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from . import kernels

MAGIC = b"P2PX"
VERSION = 1
HEADER = struct.Struct("<4sHHIIQQ")
ENTRY = struct.Struct("<QQQ")
UNITS = (1, 2, 4, 8)
MAX_POSITIONS = (1 << 31) - 1  # int32 positions
_MULT = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: odd


def _pad8(n: int) -> int:
    return -(-int(n) // 8) * 8


def _dtype(unit: int) -> Any:
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[unit]


def payload_bytes(count: int, unit: int) -> int:
    return _pad8(4 * count) + _pad8(unit * count)


def record_bytes(entries: int, count: int, unit: int) -> int:
    """Bytes of a record of ``entries`` table rows and ``count`` changed elements."""
    return HEADER.size + ENTRY.size * entries + payload_bytes(count, unit)


def checksum(payload: Any) -> Any:
    """The payload's checksum as a device scalar (int64; a uint8 tensor of a multiple of 8 bytes,
    on any device): read it with :func:`checksum_words`, once for many."""
    import torch

    if payload.numel() and payload.data_ptr() % 8 == 0 and kernels.usable(payload):
        return kernels.checksum(payload)
    words = payload.view(torch.int64)
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64).mul_(2).add_(1).mul_(_MULT)
    return words.mul(weights).sum()


def checksum_words(checks: Sequence[Any]) -> bytes:
    """The checksums (device scalars from :func:`checksum`) as the bytes the manifest's digest ends
    with: one wait for the device for all of them."""
    import torch

    if not checks:
        return b""
    values = torch.stack([c.to(torch.int64) for c in checks]).cpu().tolist()
    return b"".join(struct.pack("<Q", v & (2**64 - 1)) for v in values)


@dataclass(frozen=True)
class Found:
    """What one encode found: ``count`` changed elements of ``elements``; their positions and
    values (device tensors) unless the record would be dense (``positions`` None)."""

    unit: int
    elements: int
    count: int
    positions: Any = None  # int32, ascending
    values: Any = None  # the unit's integer dtype


class Counting:
    """One record's first pass (:func:`count_changes`), its total not read yet: ``total`` is a device
    int64 scalar (None: nothing to compare) that :func:`read_counts` reads with the other records'
    (the kernels: the changed elements; torch in words: the changed words; torch element by
    element: the changed elements); ``state`` is what the path's second pass takes."""

    def __init__(self, slot: Any, base: Any, params: Sequence[tuple[int, int, int]], unit: int, path: str,
                 state: Any, total: Any):
        self.slot, self.base, self.params, self.unit = slot, base, params, unit
        self.path, self.state, self.total = path, state, total


def find_changes(slot: Any, base: Any, params: Sequence[tuple[int, int, int]], unit: int,
                 limit: int | None = None, into: Callable[[int], Any] | None = None) -> Found:
    """Compare the parameters a slot holds with their bases and move the bases on: ``slot`` and
    ``base`` are uint8 tensors on one device, ``params`` = [(slot offset, base offset, bytes)], every
    offset and size a multiple of ``unit``. Positions are in the concatenation of ``params``. More
    than ``limit`` changes: dense (the positions are not gathered, the bases are copied).
    ``into(count)`` (optional): where the payload goes (:func:`payload_bytes`); the kernels gather
    into it directly, and :func:`write_payload` then only checksums it.

    One record alone: :func:`count_changes`, :func:`read_counts` (one wait for the device),
    :func:`gather_changes`. A sender runs the first pass of every record of a slot, reads all their
    counts at once, then gathers each (sender/delta_writes.py): one wait per slot, the same records."""
    counting = count_changes(slot, base, params, unit)
    return gather_changes(counting, read_counts([counting])[0], limit, into)


def count_changes(slot: Any, base: Any, params: Sequence[tuple[int, int, int]], unit: int) -> Counting:
    """The first pass of :func:`find_changes` (its arguments), launched without waiting for the device.

    Where every offset and size is a multiple of 8 (parameters are) and the tensors are on a CUDA
    device, the kernels of delta_find.cu count (kernels.py). Else torch compares in 8-byte words:
    one mask byte per word, counted (more changed words than the limit: dense, and the record's
    ``count`` is then the changed words' elements, an upper bound); the gather runs ``nonzero`` over
    the mask, then compares the changed words alone element by element and scatters them whole into
    the base. A unit of 8 or an odd size is compared element by element."""
    import torch

    total = sum(n // unit for _, _, n in params)
    if total > MAX_POSITIONS:
        raise ValueError(f"an index record covers at most {MAX_POSITIONS} elements, not {total}")
    if unit < 8 and all(so % 8 == 0 and bo % 8 == 0 and n % 8 == 0 for so, bo, n in params):
        if kernels.usable(slot, base) and slot.data_ptr() % 8 == 0 and base.data_ptr() % 8 == 0:
            c = kernels.count(slot, base, params, unit)
            return Counting(slot, base, params, unit, "kernels", c, None if c.ends is None else c.ends[-1])
        size, dt = 8, torch.int64
    else:
        size, dt = unit, _dtype(unit)
    su, bu = slot.view(dt), base.view(dt)
    items = [n // size for _, _, n in params]
    mask = torch.empty(sum(items), dtype=torch.bool, device=slot.device)
    starts, at = [], 0
    for (so, bo, _), k in zip(params, items):
        torch.ne(su[so // size:so // size + k], bu[bo // size:bo // size + k], out=mask[at:at + k])
        starts.append(at)
        at += k
    return Counting(slot, base, params, unit, "words" if size == 8 else "elements", (mask, starts, items),
                    mask.sum())  # the mask is an eighth of the bytes (words): counting first is cheap


def read_counts(countings: Sequence[Counting]) -> list[int]:
    """Every record's total (see :class:`Counting`): one read from each device they are on, the
    sender's one wait for the device per slot."""
    import torch

    by_device: dict[Any, list[int]] = {}
    for k, c in enumerate(countings):
        if c.total is not None:
            by_device.setdefault(c.total.device, []).append(k)
    out = [0] * len(countings)
    for ks in by_device.values():
        for k, v in zip(ks, torch.stack([countings[k].total.reshape(()) for k in ks]).cpu().tolist()):
            out[k] = int(v)
    return out


def gather_changes(c: Counting, count: int, limit: int | None = None,
                   into: Callable[[int], Any] | None = None) -> Found:
    """The second pass of :func:`find_changes` for a record whose total (:func:`read_counts`) is
    ``count``: the positions and values, the bases moved on."""
    if c.path == "kernels":
        elements, count, positions, values = kernels.gather(c.state, count, limit, into)
        if positions is None:
            return Found(c.unit, elements, count)
        return Found(c.unit, elements, count, positions, values.view(_dtype(c.unit)))
    if c.path == "words":
        return _gather_words(c, count, limit)
    return _gather_elements(c, limit)


def _gather_elements(c: Counting, limit: int | None) -> Found:
    import torch

    unit, params = c.unit, c.params
    mask, starts, elements = c.state
    su, bu = c.slot.view(_dtype(unit)), c.base.view(_dtype(unit))
    total = sum(elements)
    positions = mask.nonzero().squeeze(1)
    count = int(positions.numel())
    if limit is not None and count > limit:
        for (so, bo, _), e in zip(params, elements):
            bu[bo // unit:bo // unit + e].copy_(su[so // unit:so // unit + e])
        return Found(unit, total, count)
    at_slot, at_base = _placed(positions, params, starts, unit, c.slot.device)
    values = su[at_slot]
    bu.index_copy_(0, at_base, values)
    return Found(unit, total, count, positions.to(torch.int32), values)


def _placed(positions: Any, params: Sequence[tuple[int, int, int]], starts: Sequence[int], size: int,
            device: Any) -> tuple[Any, Any]:
    """Positions in the concatenation of ``params`` (in ``size``-byte items) -> (slot, base) item indices."""
    import torch

    if len(params) == 1:
        return positions + params[0][0] // size, positions + params[0][1] // size
    row = torch.searchsorted(torch.tensor(starts, device=device), positions, right=True) - 1
    shifts = torch.tensor([[so // size - c, bo // size - c] for (so, bo, _), c in zip(params, starts)],
                          device=device)[row]
    return positions + shifts[:, 0], positions + shifts[:, 1]


def _gather_words(c: Counting, nwords: int, limit: int | None) -> Found:
    import torch

    unit, params = c.unit, c.params
    mask, starts, words = c.state
    dt, per = _dtype(unit), 8 // unit
    sw, bw = c.slot.view(torch.int64), c.base.view(torch.int64)
    total = sum(words) * per
    if not nwords:
        return Found(unit, total, 0, torch.empty(0, dtype=torch.int32, device=c.slot.device), sw[:0].view(dt))
    if limit is not None and nwords > limit:  # each holds at least one changed element: dense
        for (so, bo, _), w in zip(params, words):
            bw[bo // 8:bo // 8 + w].copy_(sw[so // 8:so // 8 + w])
        return Found(unit, total, nwords * per)
    changed = mask.nonzero().squeeze(1)  # the changed words
    at_slot, at_base = _placed(changed, params, starts, 8, c.slot.device)
    cur = sw[at_slot]
    inside = (cur.view(dt) != bw[at_base].view(dt)).nonzero().squeeze(1)  # the changed elements of those words
    bw.index_copy_(0, at_base, cur)  # whole words: their other elements are equal
    count = int(inside.numel())
    if limit is not None and count > limit:
        return Found(unit, total, count)
    positions = changed[inside // per] * per + inside % per
    return Found(unit, total, count, positions.to(torch.int32), cur.view(dt)[inside])


def write_payload(found: Found, out: Any) -> Any:
    """Write the payload into ``out`` (uint8, 8-aligned, on the device): its checksum (a device scalar)."""
    import torch

    n4 = _pad8(4 * found.count)
    nv = _pad8(found.unit * found.count)
    if found.count and found.positions.data_ptr() == out.data_ptr() and found.values.data_ptr() == out.data_ptr() + n4:
        return checksum(out[:n4 + nv])  # gathered in place (find_changes' ``into``), padding zeroed
    out[:n4 + nv].zero_()
    out[:4 * found.count].view(torch.int32).copy_(found.positions)
    out[n4:n4 + found.unit * found.count].view(_dtype(found.unit)).copy_(found.values)
    return checksum(out[:n4 + nv])


def header_and_table(found: Found, table: Sequence[tuple[int, int, int]]) -> bytes:
    """The record's header and table (host bytes): ``table`` = [(position, elements, dest)]."""
    return HEADER.pack(MAGIC, VERSION, found.unit, len(table), 0, found.count, 0) + b"".join(
        ENTRY.pack(*row) for row in table)


def parse_header(head: bytes) -> tuple[int, int, int, int]:
    """(unit, entries, count, checksum) of a record's header; ValueError names what is wrong."""
    magic, version, unit, entries, _reserved, count, check = HEADER.unpack(head[:HEADER.size])
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"not an index record of version {VERSION} (magic {magic!r}, version {version})")
    if unit not in UNITS:
        raise ValueError(f"unit {unit} is not one of {UNITS}")
    if not 1 <= entries or count > MAX_POSITIONS:
        raise ValueError(f"{entries} table rows and {count} changes")
    return unit, entries, count, check


def table_rows(head: bytes, table: bytes, nbytes: int,
               regions: Sequence[tuple[int, int]]) -> tuple[int, int, int, list[tuple[int, int, int, int]]]:
    """Check one record's header and table on the host (``nbytes``: the record's bytes as its prefix
    says; ``regions``: the rank's weights as (address, bytes)): (unit, count, elements of the table,
    rows), each row (position, elements, region, byte offset in the region). ValueError names the
    first fault. The payload's checks run on the device, for all records at once (index_apply.py)."""
    unit, entries, count, _ = parse_header(head)
    if record_bytes(entries, count, unit) != nbytes:
        raise ValueError(f"it claims {nbytes} bytes for {entries} table rows and {count} changes")
    if len(table) != ENTRY.size * entries:
        raise ValueError(f"the table holds {len(table)} bytes for {entries} rows")
    order = sorted(range(len(regions)), key=lambda i: regions[i][0])
    starts = [regions[i][0] for i in order]
    rows, at = [], 0
    for k, (position, elements, dest) in enumerate(ENTRY.iter_unpack(table)):
        if position != at or elements == 0:
            raise ValueError(f"table row {k} starts at {position} (expected {at}) with {elements} elements")
        r = order[bisect.bisect_right(starts, dest) - 1] if starts and dest >= starts[0] else -1
        a, n = regions[r] if r >= 0 else (0, 0)
        # a region that does not hold it may overlap one that does: look at every one then
        if r < 0 or dest + elements * unit > a + n:
            r = next((i for i, (a, n) in enumerate(regions) if a <= dest and dest + elements * unit <= a + n), -1)
            a = regions[r][0] if r >= 0 else 0
        if r < 0 or dest % unit or (dest - a) % unit:
            raise ValueError(f"table row {k} writes [{dest:#x}, +{elements * unit}), outside this rank's weights "
                             f"or off its {unit}-byte elements")
        rows.append((position, elements, r, dest - a))
        at += elements
    return unit, count, at, rows
