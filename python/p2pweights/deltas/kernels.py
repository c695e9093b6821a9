"""The GPU delta kernels behind index_records.py and index_apply.py. The sender's
(csrc/kernels/delta_find.cu): change detection in two launches per record, the count pass of
every record of a slot launched before one wait for the device reads all their totals (to size the
payloads), then the gathers; and the payload's checksum in one launch.
The engine rank's (csrc/kernels/delta_apply.cu): every index record of its area checked in one
launch (read back in one copy), then applied in one launch. Where the native module was built
without nvcc, or the tensors are not on a CUDA device, torch does the same; both give the same
records, verdicts and weights, byte for byte (tests/test_delta_kernels.py).

``ENABLED`` switches the kernels off for a process (benchmarks compare both ways).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from .. import _native
from ..errors import raise_for_status

ENABLED = True
BLOCK_BYTES = int(_native.DELTA_BLOCK_BYTES)  # slot bytes per count/gather block
_WORDS = BLOCK_BYTES // 8
_MASK_WORDS = _WORDS // 32  # uint32 mask words per block
_GROUPS = int(_native.DELTA_GROUPS_PER_BLOCK)  # counts per block
_SPANS: dict[tuple, tuple[Any, int, int]] = {}  # (slot, base, params) -> (device int64[n, 5], blocks, words)
_MAX_SPANS = 4096
_DRIVER: dict | None = None  # cuda_driver_info(), read once
CHECK_WORDS = int(getattr(_native, "DELTA_CHECK_WORDS", 4096))  # payload words per check block
APPLY_ELEMENTS = int(getattr(_native, "DELTA_APPLY_ELEMENTS", 2048))  # changed elements per apply block


def usable(*tensors: Any) -> bool:
    """Whether the kernels run for these tensors: built in, switched on, every tensor on a CUDA device."""
    return ENABLED and _native.delta_kernels_embedded() and all(t.is_cuda for t in tensors)


def apply_usable(*tensors: Any) -> bool:
    """Whether the engine side's kernels (delta_apply.cu) run for these tensors."""
    built = getattr(_native, "delta_apply_kernels_embedded", None)  # a module built before them: no
    return ENABLED and built is not None and built() and all(t.is_cuda for t in tensors)


def _check(answer: tuple, what: str) -> None:
    code, message = answer
    if code != int(_native.Code.OK):
        raise_for_status(code, f"{what}: {message}")


def _stream(t: Any) -> int:
    import torch

    return int(torch.cuda.current_stream(t.device).cuda_stream)


def _spans(slot: Any, base: Any, params: Sequence[tuple[int, int, int]]) -> tuple[Any, int, int]:
    """The record's spans on the device (kept: a slot's records repeat every update), its blocks and words."""
    import torch

    key = (slot.data_ptr(), base.data_ptr(), slot.device.index, tuple(params))
    got = _SPANS.get(key)
    if got is not None:
        return got
    rows, words, blocks = [], 0, 0
    for so, bo, n in params:
        w = n // 8
        rows.append((slot.data_ptr() + so, base.data_ptr() + bo, w, words, blocks))
        words += w
        blocks += -(-w // _WORDS)
    if len(_SPANS) >= _MAX_SPANS:
        _SPANS.clear()
    got = (torch.tensor(rows, dtype=torch.int64).to(slot.device), blocks, words)
    _SPANS[key] = got
    return got


def forget() -> None:
    """Drop the kept spans (their addresses name slots and bases that were freed)."""
    _SPANS.clear()


class Counted:
    """One record's count pass, launched: its mask and each group's end (an inclusive scan of the
    group counts) on the device. ``ends`` is None for a record of no words. Its total (``ends[-1]``)
    is read with the other records of its slot (index_records.read_counts), then :func:`gather` runs."""

    def __init__(self, slot: Any, base: Any, params: Sequence[tuple[int, int, int]], unit: int, spans: Any,
                 blocks: int, words: int, mask: Any = None, ends: Any = None):
        self.slot, self.base, self.params, self.unit = slot, base, params, unit
        self.spans, self.blocks, self.words, self.mask, self.ends = spans, blocks, words, mask, ends


def count(slot: Any, base: Any, params: Sequence[tuple[int, int, int]], unit: int) -> Counted:
    """Launch the count pass of the record of ``params`` (index_records.find_changes' arguments, every
    offset and size a multiple of 8, ``unit`` 1, 2 or 4) and the scan of its counts; no wait."""
    import torch

    spans, blocks, words = _spans(slot, base, params)
    if not blocks:
        return Counted(slot, base, params, unit, spans, 0, words)
    mask = torch.empty(blocks * _MASK_WORDS, dtype=torch.int32, device=slot.device)
    counts = torch.empty(blocks * _GROUPS, dtype=torch.int64, device=slot.device)
    _check(_native.delta_find_count(spans.data_ptr(), spans.shape[0], unit, mask.data_ptr(), counts.data_ptr(),
                                    blocks, _stream(slot)), "delta count")
    return Counted(slot, base, params, unit, spans, blocks, words, mask, torch.cumsum(counts, 0))


def gather(c: Counted, count: int, limit: int | None,
           into: Callable[[int], Any] | None = None) -> tuple[int, int, Any, Any]:
    """(elements, changed, positions, values) of a counted record whose total is ``count``. The bases
    move on: the changed words alone when the positions are gathered, every byte when there are more
    than ``limit`` changes (positions and values None). ``into(count)``: the payload's place (uint8,
    8-aligned, index_records.payload_bytes(count, unit)); the positions and values are gathered
    straight into it, its padding zeroed (no copy after)."""
    import torch

    slot, unit = c.slot, c.unit
    elements = c.words * (8 // unit)
    if count == 0:
        return elements, 0, torch.empty(0, dtype=torch.int32, device=slot.device), slot[:0]
    if limit is not None and count > limit:
        copy_spans(slot, c.base, c.params)
        return elements, count, None, None
    if into is not None:
        out = into(count)
        n4, nv = -(-4 * count // 8) * 8, -(-unit * count // 8) * 8
        positions, values = out[:4 * count].view(torch.int32), out[n4:n4 + unit * count]
        for pad in (out[4 * count:n4], out[n4 + unit * count:n4 + nv]):
            if pad.numel():
                pad.zero_()
    else:
        positions = torch.empty(count, dtype=torch.int32, device=slot.device)
        values = torch.empty(count * unit, dtype=torch.uint8, device=slot.device)
    _check(_native.delta_find_gather(c.spans.data_ptr(), c.spans.shape[0], unit, c.mask.data_ptr(),
                                     c.ends.data_ptr(), positions.data_ptr(), values.data_ptr(), c.blocks,
                                     _stream(slot)), "delta gather")
    return elements, count, positions, values


def _driver() -> dict:
    global _DRIVER
    if _DRIVER is None:
        _DRIVER = dict(_native.cuda_driver_info())
    return _DRIVER


def copy_spans(slot: Any, base: Any, params: Sequence[tuple[int, int, int]]) -> None:
    """Every (slot offset, base offset, bytes) of ``params`` copied from ``slot`` into ``base`` (uint8
    tensors of one device): on a CUDA device as one copy program (the batched copy kernel, one launch
    per 64 parameters: a base moved on in full costs no launch per parameter), else one copy each."""
    import numpy as np

    driver = _driver()
    if len(params) > 1 and all(t.is_cuda for t in (slot, base)) and driver["loaded"]:
        program = np.array([(0, bo, so, n, 1, n, n) for so, bo, n in params if n], dtype=np.int64).reshape(-1, 7)
        mode = "kernel" if driver["kernel"] else "each"
        code, message, _ = _native.run_copy_program_cuda(program, base.data_ptr(), base.numel(), [slot.data_ptr()],
                                                         [slot.numel()], _stream(slot), mode, 1)
        _check((code, message), "copying the bases")
        return
    for so, bo, n in params:
        base[bo:bo + n].copy_(slot[so:so + n])


def checksum(payload: Any) -> Any:
    """index_records.checksum of a CUDA payload (uint8, 8-aligned, a multiple of 8 bytes), one launch."""
    import torch

    out = torch.zeros(1, dtype=torch.int64, device=payload.device)
    _check(_native.payload_checksum(payload.data_ptr(), payload.numel() // 8, out.data_ptr(), _stream(payload)),
           "payload checksum")
    return out[0]


class Launched:
    """An area's index records on the device (delta_apply.cu's Record and Row arrays) and their
    verdicts, read back: per record (checksum, faults)."""

    def __init__(self, records: Any, n_records: int, rows: Any, apply_blocks: int, verdicts: Any, stream: int):
        self.records, self.n_records, self.rows, self.apply_blocks = records, n_records, rows, apply_blocks
        self.verdicts, self.stream = verdicts, stream


def records_check(descriptors: tuple[list, list, int, int], like: Any) -> Launched:
    """index_apply's records (``descriptors``: Record rows, Row rows, check grid, apply grid) uploaded
    in one copy and checked in one launch on ``like``'s device; the verdicts read in one copy (the wait)."""
    import torch

    recs, rows, check_blocks, apply_blocks = descriptors
    host = torch.tensor([v for r in recs for v in r] + [v for r in rows for v in r], dtype=torch.int64)
    flat = host.to(like.device, non_blocking=True)  # pageable: staged before it returns, no wait
    records, table = flat[:8 * len(recs)], flat[8 * len(recs):]
    verdicts = torch.zeros(2 * len(recs), dtype=torch.int64, device=like.device)
    stream = _stream(like)
    _check(_native.delta_records_check(records.data_ptr(), len(recs), verdicts.data_ptr(), check_blocks, stream),
           "delta records check")
    return Launched(records, len(recs), table, apply_blocks, verdicts.view(-1, 2).cpu(), stream)


def records_apply(launched: Launched) -> None:
    """Every checked record applied: one launch (on the stream that checked them)."""
    _check(_native.delta_records_apply(launched.records.data_ptr(), launched.n_records, launched.rows.data_ptr(),
                                       launched.apply_blocks, launched.stream), "delta records apply")
