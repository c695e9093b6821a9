"""The device side of an engine rank's index records: every record of its delta area checked at
once, then applied at once, after the host checked each header and table (area.py,
index_records.table_rows).

Where the native module was built with nvcc and the area and the weights are on one CUDA device,
two kernels of csrc/kernels/delta_apply.cu do it (kernels.py): ``p2pw_records_check`` computes
every record's payload checksum and counts its positions that are not strictly ascending inside
its table, one launch for the area, read back in one copy (:func:`verdicts`); ``p2pw_records_apply``
stores every changed element at its row's destination, one launch for the area (:func:`apply`).
Without them (no nvcc, a CPU area, ``kernels.ENABLED = False``) torch does the same per record:
the verdicts of all records still come back in one copy; the apply is one scatter per weight region
a record touches. Both give the same verdicts, so the same refusals, and the same weights
(tests/test_delta_kernels.py, tests/test_delta_index_records.py).

The apply uses only what the host checked (the rows, the counts) and skips a position outside its
record's table (a late write into the area after the checks): it never stores outside the rows.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Sequence

from . import index_records, kernels


@dataclass
class Record:
    """An index record whose header and table the host checked."""

    at: int  # its byte in the area (for messages)
    payload: Any  # uint8 tensor on the area's device
    unit: int
    count: int
    total: int  # elements of its table: positions lie in [0, total)
    rows: list  # [(position, elements, region, byte offset in the region)], ascending


@dataclass
class Checked:
    """Every index record of an area with its device verdicts; :func:`apply` takes it."""

    records: list
    tensors: list  # the weight regions as uint8 tensors
    checksums: list = field(default_factory=list)  # each record's payload checksum (int, mod 2^64)
    bad: list = field(default_factory=list)  # the indices of records whose positions are wrong
    device: Any = None  # the uploaded descriptors (kernel path)

    def checksum_words(self) -> bytes:
        """What the manifest's digest ends with (index_records.checksum_words' bytes)."""
        return b"".join(struct.pack("<Q", c) for c in self.checksums)


def _kernels(records: Sequence[Record], tensors: Sequence[Any]) -> bool:
    if not records or not kernels.apply_usable(records[0].payload, *tensors):
        return False
    device = records[0].payload.device
    return all(t.device == device for t in tensors)


def verdicts(records: Sequence[Record], tensors: Sequence[Any]) -> Checked:
    """Every record's checksum and position check, on the device, read back in one copy."""
    out = Checked(list(records), list(tensors))
    if not records:
        return out
    if _kernels(records, tensors):
        out.device = kernels.records_check(_descriptors(records, tensors), records[0].payload)
        got = out.device.verdicts
    else:
        import torch

        got = torch.stack([torch.stack([index_records.checksum(r.payload), _faults(r)]) for r in records]).cpu()
    for k, (check, faults) in enumerate(got.tolist()):
        out.checksums.append(check & (2**64 - 1))
        if faults:
            out.bad.append(k)
    return out


def _faults(r: Record) -> Any:
    """1 (a device scalar) when the record's positions are not strictly ascending inside [0, total)."""
    import torch

    if r.count == 0:
        return torch.zeros((), dtype=torch.int64, device=r.payload.device)
    positions = r.payload[:4 * r.count].view(torch.int32)
    bad = (positions[0] < 0) | (positions[-1] >= r.total)
    if r.count > 1:
        bad = bad | (positions[1:] <= positions[:-1]).any()
    return bad.to(torch.int64)


def _descriptors(records: Sequence[Record], tensors: Sequence[Any]) -> tuple[list, list, int, int]:
    """The kernels' Record and Row arrays (delta_apply.cu) and both grids."""
    recs, rows, check_blocks, apply_blocks = [], [], 0, 0
    for r in records:
        words = index_records.payload_bytes(r.count, r.unit) // 8
        recs.append((r.payload.data_ptr(), r.count, r.unit, r.total, check_blocks, apply_blocks, len(rows),
                     len(r.rows)))
        rows += [(position, elements, tensors[region].data_ptr() + offset)
                 for position, elements, region, offset in r.rows]
        check_blocks += -(-words // kernels.CHECK_WORDS)
        apply_blocks += -(-r.count // kernels.APPLY_ELEMENTS)
    return recs, rows, check_blocks, apply_blocks


def apply(checked: Checked) -> None:
    """Apply every record (their verdicts passed, and the host's digest): one launch, or torch."""
    if checked.device is not None:
        kernels.records_apply(checked.device)
        return
    for r in checked.records:
        _apply_one(r, checked.tensors)


def _apply_one(r: Record, tensors: Sequence[Any]) -> None:
    import torch

    if r.count == 0:
        return
    device = r.payload.device
    positions = r.payload[:4 * r.count].view(torch.int32).to(torch.int64)
    positions = positions.clamp(0, r.total - 1)  # checked ascending inside; a late write stays inside the rows
    values = r.payload[-(-4 * r.count // 8) * 8:][:r.unit * r.count].view(index_records._dtype(r.unit))
    starts = _upload([row[0] for row in r.rows], torch.int64, device)
    row = torch.searchsorted(starts, positions, right=True) - 1
    shift = _upload([offset // r.unit - position for position, _, _, offset in r.rows], torch.int64, device)
    index = positions + shift[row]
    used = sorted({region for _, _, region, _ in r.rows})
    for region in used:
        tensor = tensors[region].view(index_records._dtype(r.unit))
        if len(used) == 1:
            tensor.index_copy_(0, index, values)
            continue
        mine = _upload([rr[2] == region for rr in r.rows], torch.bool, device)[row]
        tensor.index_copy_(0, index[mine], values[mine])


def _upload(values: list, dtype: Any, device: Any) -> Any:
    """A small host list on ``device`` without waiting for the stream (``torch.tensor(..., device=)``
    waits; a pageable non-blocking copy is staged before it returns)."""
    import torch

    t = torch.tensor(values, dtype=dtype)
    return t if t.device == torch.device(device) else t.to(device, non_blocking=True)
