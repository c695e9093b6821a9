"""A recorded copy plan's ops as byte copies, and their replay as torch views (replica/copy_plan.py).

:func:`byte_ops` turns ops of elements into copies of bytes (contiguous dimensions folded, ops
that continue each other joined): the shared first step of the wide replay below and of the
native replay (native_copies.py). :func:`widen_ops` then picks for each the widest element
dividing its runs, strides and offsets; :func:`run_wide_ops` applies them as ``as_strided`` views
(the host-slot path where the native core is not built, and a baseline of the benchmark).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .element_ops import int_dtype as _int_dtype
from .groups import SlotRegion

if TYPE_CHECKING:
    import torch

# one op of a plan (copy_plan.Op): (input index or -1 for a zero fill, region index, dst offset,
# src offset, sizes, dst strides, src strides); offsets and strides in elements of the region's size
Op = tuple[int, int, int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]

# one wide op: (input index or -1 for a zero fill, element width in bytes, dst byte offset from the
# group's start, src byte offset from the input's start, sizes, dst strides, src strides); sizes and
# strides in elements of that width. Copies of uint8 elements are not vectorised (one byte per
# thread on a GPU, strided ones byte by byte on a host): the widest element that divides every
# run, stride and offset moves the same bytes with 2-8x fewer, wider loads.
WideOp = tuple[int, int, int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]
_WIDTHS = (8, 4, 2, 1)
MEMCPY_BYTES = 1 << 20  # a dense copy this large gets a copy of its own (memcpy), not a batch slot


def _collapse(sizes: list[int], strides: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """Drop size-1 dimensions and fold a dimension into the next inner one where every side is
    contiguous across them (a row-contiguous 2-D copy becomes 1-D)."""
    keep = [i for i, n in enumerate(sizes) if n != 1] or [len(sizes) - 1]
    sizes = [sizes[i] for i in keep]
    strides = [[st[i] for i in keep] for st in strides]
    i = len(sizes) - 2
    while i >= 0:
        if all(st[i] == sizes[i + 1] * st[i + 1] for st in strides):
            sizes[i + 1] *= sizes[i]
            del sizes[i]
            for st in strides:
                del st[i]
        i -= 1
    return sizes, strides


def _to_bytes(op: Op, regions: Sequence[SlotRegion], itemsizes: Sequence[int]) -> WideOp:
    inp, reg, d_off, s_off, sizes, d_str, s_str = op
    size = itemsizes[reg]
    strides = [[x * size for x in d_str] + [1]] + ([[x * size for x in s_str] + [1]] if inp >= 0 else [])
    shape, strides = _collapse(list(sizes) + [size], strides)
    s_strides = strides[1] if inp >= 0 else [0] * len(shape)
    return (inp, 1, regions[reg].offset + d_off * size, s_off * size if inp >= 0 else 0,
            tuple(shape), tuple(strides[0]), tuple(s_strides))


def _widest(op: WideOp) -> WideOp:
    inp, _, d_off, s_off, sizes, d_str, s_str = op
    values = [sizes[-1], d_off, *d_str[:-1]] + ([s_off, *s_str[:-1]] if inp >= 0 else [])
    contiguous = d_str[-1] == 1 and (inp < 0 or s_str[-1] == 1)
    for w in _WIDTHS:
        if w == 1 or (contiguous and all(v % w == 0 for v in values)):
            break
    sizes = sizes[:-1] + (sizes[-1] // w,)
    d_str = tuple(x // w for x in d_str[:-1]) + (d_str[-1],)
    s_str = tuple(x // w for x in s_str[:-1]) + (s_str[-1],) if inp >= 0 else s_str
    return (inp, w, d_off, s_off, sizes, d_str, s_str)


def widen_ops(ops: Sequence[Op], regions: Sequence[SlotRegion], itemsizes: Sequence[int]) -> list[WideOp]:
    """Ops as byte copies (:func:`byte_ops`), each of the widest element dividing its runs and offsets."""
    return [_widest(op) for op in byte_ops(ops, regions, itemsizes)]


def byte_ops(ops: Sequence[Op], regions: Sequence[SlotRegion], itemsizes: Sequence[int]) -> list[WideOp]:
    """Ops as copies of bytes (width 1): contiguous dimensions folded, ops that continue each other
    (same input, both sides adjacent) joined. The native replay (native_copies.py) starts here too."""
    out: list[WideOp] = []
    for op in ops:
        b = _to_bytes(op, regions, itemsizes)
        if out and len(b[4]) == 1 and len(out[-1][4]) == 1 and b[5] == (1,) and out[-1][5] == (1,):
            p = out[-1]
            if p[0] == b[0] and p[2] + p[4][0] == b[2] and (b[0] < 0 or (p[6] == b[6] == (1,) and p[3] + p[4][0] == b[3])):
                out[-1] = (p[0], 1, p[2], p[3], (p[4][0] + b[4][0],), p[5], p[6])
                continue
        out.append(b)
    return out


def _narrowed(op: WideOp, w: int) -> WideOp:
    """The same bytes in elements of width ``w`` (which divides the op's)."""
    inp, width, d_off, s_off, sizes, d_str, s_str = op
    f = width // w
    sizes = sizes + (f,)
    d_str = tuple(x * f for x in d_str) + (1,)
    s_str = tuple(x * f for x in s_str) + (1,) if inp >= 0 else s_str + (0,)
    shape, strides = _collapse(list(sizes), [list(d_str), list(s_str)] if inp >= 0 else [list(d_str)])
    return (inp, w, d_off, s_off, tuple(shape), tuple(strides[0]),
            tuple(strides[1]) if inp >= 0 else (0,) * len(shape))


def _alignment(byte_offset: int) -> int:
    return next(w for w in _WIDTHS if byte_offset % w == 0)


def _storage_view(t: "torch.Tensor", width: int, cache: dict) -> "torch.Tensor":
    """``t``'s whole storage as integers of ``width`` bytes (as_strided then checks every op's bounds)."""
    import torch

    key = (t.untyped_storage().data_ptr(), t.device, width)
    view = cache.get(key)
    if view is None:
        storage = t.untyped_storage()
        view = cache[key] = torch.empty(0, dtype=_int_dtype(width), device=t.device).set_(
            storage, 0, (storage.nbytes() // width,), (1,))
    return view


def run_wide_ops(ops: Sequence[WideOp], inputs: Sequence["torch.Tensor"], slot: "torch.Tensor", slot_base: int) -> None:
    """Apply wide ops: the group starts ``slot_base`` bytes into ``slot``'s storage. A dense copy of
    at least :data:`MEMCPY_BYTES` is one ``copy_`` (a plain memcpy, the fastest a device copies);
    smaller dense copies of one width go to one ``torch._foreach_copy_`` (one multi-tensor kernel
    on a GPU instead of a launch each), strided ones to another, zero fills to one
    ``torch._foreach_zero_``."""
    import torch

    bases = [t.storage_offset() * t.element_size() for t in inputs]
    # an input not aligned to an op's width (a view into a larger buffer): narrower elements
    limit = [min(_alignment(b), _alignment(t.data_ptr())) for b, t in zip(bases, inputs)]
    slot_limit = min(_alignment(slot_base), _alignment(slot.data_ptr() - slot.storage_offset() * slot.element_size()))
    cache: dict = {}
    same_device = all(t.device == slot.device for t in inputs)
    batches: dict[tuple[int, bool], tuple[list, list]] = {}
    zeros = []
    for op in ops:
        inp, w = op[0], op[1]
        cap = min(slot_limit, limit[inp]) if inp >= 0 else slot_limit
        if w > cap:
            op = _narrowed(op, cap)
            w = cap
        _, _, d_off, s_off, sizes, d_str, s_str = op
        dst = _storage_view(slot, w, cache).as_strided(sizes, d_str, (slot_base + d_off) // w)
        if inp < 0:
            zeros.append(dst)
            continue
        src = _storage_view(inputs[inp], w, cache).as_strided(sizes, s_str, (bases[inp] + s_off) // w)
        dense = len(sizes) == 1 and d_str[0] == 1 and s_str[0] == 1
        if dense and sizes[0] * w >= MEMCPY_BYTES:
            dst.copy_(src, non_blocking=True)
            continue
        pair = batches.setdefault((w, dense), ([], []))
        pair[0].append(dst)
        pair[1].append(src)
    if zeros:
        torch._foreach_zero_(zeros)
    for dsts, srcs in batches.values():
        if same_device:
            torch._foreach_copy_(dsts, srcs)
        else:  # inputs on another device than the slot: one copy each (H2D / D2H)
            for d, s in zip(dsts, srcs):
                d.copy_(s, non_blocking=True)
