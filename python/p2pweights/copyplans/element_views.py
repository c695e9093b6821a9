"""Replay of a recorded copy plan as element views: the last path of every replay order (replay.py),
for slots the native copies cannot take (inputs on another device, native copies off).

Each op becomes a view of its region's element size (no widening, no folding) and the whole group
goes to one ``torch._foreach_copy_`` (plus one ``torch._foreach_zero_``): on the H200 that beat the
wide copies, whose per-op dispatch bounds a GPU slot (benchmarks/RESULTS.md).

:func:`int_dtype` is the one map from an element size to the integer dtype that views it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from .group_plan import NotACopy

if TYPE_CHECKING:
    import torch

_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def int_dtype(size: int) -> "torch.dtype":
    import torch

    try:
        return getattr(torch, _INT_OF_SIZE[size])
    except KeyError:
        raise NotACopy("", f"element size {size} has no integer view") from None


def run_element_ops(ops: Sequence[Any], regions: Sequence[Any], itemsizes: Sequence[int],
                    inputs: Sequence["torch.Tensor"], slot: "torch.Tensor") -> None:
    """Apply ops as views of each region's element size (no widening): every copy of the group in
    one ``torch._foreach_copy_``, every zero fill in one ``torch._foreach_zero_``. ``slot`` starts
    at the group's first byte."""
    import torch

    dst = [slot[r.offset:r.offset + r.nbytes].view(int_dtype(s)) for r, s in zip(regions, itemsizes)]
    src = [t.reshape(-1).view(int_dtype(t.element_size())) for t in inputs]
    dsts, srcs, zeros = [], [], []
    for inp, reg, d_off, s_off, sizes, d_str, s_str in ops:
        d = dst[reg].as_strided(sizes, d_str, dst[reg].storage_offset() + d_off)
        if inp < 0:
            zeros.append(d)
        else:
            dsts.append(d)
            srcs.append(src[inp].as_strided(sizes, s_str, src[inp].storage_offset() + s_off))
    if zeros:
        torch._foreach_zero_(zeros)
    if dsts:
        if all(s.device == slot.device for s in srcs):
            torch._foreach_copy_(dsts, srcs)
        else:  # inputs on another device than the slot: one copy each (H2D / D2H)
            for d, s_ in zip(dsts, srcs):
                d.copy_(s_, non_blocking=True)

