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

``checksum`` is a 64-bit sum of the payload's words, each times an odd multiplier of its position,
computed on the device on both sides (a changed word always changes it). The area's manifest
(area.py) takes the SHA-256 of every record's prefix, header and table, so the owner's word covers
the whole record without moving its payload to a host: the digest proves where each byte goes and
how many there are, the checksum that the payload is the one the owner wrote.

The engine rank checks a record whole before any is applied (:func:`check`: the table inside its
weights, positions ascending and inside the concatenation, the checksum), then applies it
(:func:`apply`: one scatter per weight region the record touches).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Sequence

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


def checksum(payload: Any) -> int:
    """The payload's checksum (a uint8 tensor of a multiple of 8 bytes, on any device)."""
    import torch

    words = payload.view(torch.int64)
    if not words.numel():
        return 0
    weights = torch.arange(words.numel(), device=words.device, dtype=torch.int64).mul_(2).add_(1).mul_(_MULT)
    return int(words.mul(weights).sum().item())


@dataclass(frozen=True)
class Found:
    """What one encode found: the changed positions and their values (device tensors)."""

    unit: int
    elements: int
    positions: Any  # int32, ascending
    values: Any  # the unit's integer dtype

    @property
    def count(self) -> int:
        return int(self.positions.numel())


def find_changes(slot: Any, base: Any, params: Sequence[tuple[int, int, int]], unit: int) -> Found:
    """Compare the parameters a slot holds with their bases and move the bases on: ``slot`` and
    ``base`` are uint8 tensors on one device, ``params`` = [(slot offset, base offset, bytes)], every
    offset and size a multiple of ``unit``. Positions are in the concatenation of ``params``.

    Three passes over the slot's bytes: the compare (slot and base read, one mask byte written per
    element), ``nonzero`` over the mask (the one synchronization), then the changed elements alone
    are gathered and scattered into the base."""
    import torch

    dt = _dtype(unit)
    su, bu = slot.view(dt), base.view(dt)
    elements = [n // unit for _, _, n in params]
    total = sum(elements)
    if total > MAX_POSITIONS:
        raise ValueError(f"an index record covers at most {MAX_POSITIONS} elements, not {total}")
    mask = torch.empty(total, dtype=torch.bool, device=slot.device)
    starts, at = [], 0
    for (so, bo, _), e in zip(params, elements):
        torch.ne(su[so // unit:so // unit + e], bu[bo // unit:bo // unit + e], out=mask[at:at + e])
        starts.append(at)
        at += e
    positions = mask.nonzero().squeeze(1)
    if positions.numel() and len(params) > 1:
        row = torch.searchsorted(torch.tensor(starts, device=slot.device), positions, right=True) - 1
        shifts = torch.tensor([[so // unit - c, bo // unit - c] for (so, bo, _), c in zip(params, starts)],
                              device=slot.device)[row]
        at_slot, at_base = positions + shifts[:, 0], positions + shifts[:, 1]
    else:
        at_slot = positions + params[0][0] // unit if params else positions
        at_base = positions + params[0][1] // unit if params else positions
    values = su[at_slot]
    bu.index_copy_(0, at_base, values)
    return Found(unit, total, positions.to(torch.int32), values)


def write_payload(found: Found, out: Any) -> int:
    """Write the payload into ``out`` (uint8, 8-aligned, on the device): its checksum."""
    import torch

    n4 = _pad8(4 * found.count)
    nv = _pad8(found.unit * found.count)
    out[:n4 + nv].zero_()
    out[:4 * found.count].view(torch.int32).copy_(found.positions)
    out[n4:n4 + found.unit * found.count].view(_dtype(found.unit)).copy_(found.values)
    return checksum(out[:n4 + nv])


def header_and_table(found: Found, table: Sequence[tuple[int, int, int]], check: int) -> bytes:
    """The record's header and table (host bytes): ``table`` = [(position, elements, dest)]."""
    return HEADER.pack(MAGIC, VERSION, found.unit, len(table), 0, found.count, check & (2**64 - 1)) + b"".join(
        ENTRY.pack(*row) for row in table)


@dataclass
class Checked:
    """A checked record, ready to apply: per weight region, the element indices and values."""

    scatters: list  # [(region tensor viewed as the unit's dtype, int64 indices, values)]


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


def check(head: bytes, table: bytes, payload: Any, regions: Sequence[tuple[int, int, Any]]) -> Checked:
    """Check one record whole (``regions``: the rank's weights as (address, bytes, uint8 tensor));
    ValueError names the first fault. Nothing is applied."""
    import torch

    unit, entries, count, want = parse_header(head)
    if len(table) != ENTRY.size * entries:
        raise ValueError(f"the table holds {len(table)} bytes for {entries} rows")
    if payload.numel() != payload_bytes(count, unit):
        raise ValueError(f"the payload holds {payload.numel()} bytes for {count} changes of {unit} bytes")
    rows, at = [], 0
    for k in range(entries):
        position, elements, dest = ENTRY.unpack_from(table, k * ENTRY.size)
        if position != at or elements == 0:
            raise ValueError(f"table row {k} starts at {position} (expected {at}) with {elements} elements")
        where = [i for i, (a, n, _) in enumerate(regions) if a <= dest and dest + elements * unit <= a + n]
        if not where or (dest - regions[where[0]][0]) % unit:
            raise ValueError(f"table row {k} writes [{dest:#x}, +{elements * unit}), outside this rank's weights "
                             f"or off its {unit}-byte elements")
        rows.append((position, elements, where[0], (dest - regions[where[0]][0]) // unit))
        at += elements
    got = checksum(payload) & (2**64 - 1)
    if got != want:
        raise ValueError("its payload is not the one the owner wrote (checksum differs)")
    if count == 0:
        return Checked([])
    n4 = _pad8(4 * count)
    positions = payload[:4 * count].view(torch.int32).to(torch.int64)
    values = payload[n4:n4 + unit * count].view(_dtype(unit))
    bad = (positions[0] < 0) | (positions[-1] >= at)
    if count > 1:
        bad = bad | (positions[1:] <= positions[:-1]).any()
    if bool(bad.item()):
        raise ValueError(f"its positions are not ascending inside the record's {at} elements")
    starts = torch.tensor([r[0] for r in rows], dtype=torch.int64, device=positions.device)
    row = torch.searchsorted(starts, positions, right=True) - 1
    shift = torch.tensor([r[3] - r[0] for r in rows], dtype=torch.int64, device=positions.device)
    index = positions + shift[row]
    scatters = []
    used = sorted({r[2] for r in rows})
    for region in used:
        tensor = regions[region][2].view(_dtype(unit))
        if len(used) == 1:
            scatters.append((tensor, index, values))
            continue
        in_region = torch.tensor([r[2] == region for r in rows], device=positions.device)[row]
        scatters.append((tensor, index[in_region], values[in_region]))
    return Checked(scatters)


def apply(checked: Checked) -> None:
    """Apply a checked record: one scatter per weight region it touches."""
    for tensor, index, values in checked.scatters:
        tensor.index_copy_(0, index, values)
