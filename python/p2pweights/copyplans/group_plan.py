"""A recorded copy plan: how to produce one parameter group's slot bytes from its HF inputs.

A plan is a list of strided copies (:data:`Op`) of input elements into the group's regions, made by
recording the group's loaders (record.py). It is data: stored on disk (store.py), compiled to a
native copy program (program.py) and replayed (replay.py). Only :meth:`GroupPlan.precheck` looks at
its numbers in Python, and only at their shape (indices that name an input and a region, sizes and
strides that make sense); whether every byte stays inside the group's bytes and each input, and no
two copies write one byte, is the native core's one check (``check_copy_program``), run when the
plan is compiled.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..replica.groups import SlotRegion

if TYPE_CHECKING:
    import torch

# one op: (input index or -1 for a zero fill, region index, dst offset, src offset, sizes,
# dst strides, src strides); offsets and strides in elements of the region's dtype size
Op = tuple[int, int, int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]
MAX_DIMS = 4  # a copy op has at most this many dimensions


class NotACopy(Exception):
    """The loaders' bytes for a parameter are not a pure copy of input bytes (why, parameter)."""

    def __init__(self, parameter: str, why: str):
        super().__init__(f"{parameter}: {why}")
        self.parameter = parameter
        self.why = why


@dataclass
class GroupPlan:
    """How to produce one group's slot bytes from its HF inputs without the loaders."""

    group_index: int
    inputs: tuple[str, ...]  # HF names, in the order ops index them
    input_specs: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) per input, as recorded
    regions: tuple[SlotRegion, ...]  # the group's parameters, offsets from the group's start
    itemsizes: tuple[int, ...]  # element size of each region
    ops: list[Op] = field(default_factory=list)  # fixed once compiled (the program is cached below)
    # program.py's compiled and natively checked program (None: not compiled yet; False: refused)
    _program: Any = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        """Memory the plan holds (its op tuples), for the report."""
        total = sys.getsizeof(self.ops)
        for op in self.ops:
            total += sys.getsizeof(op) + sum(sys.getsizeof(t) for t in op[4:])
        return total

    @property
    def group_bytes(self) -> int:
        """The group's bytes in a slot (its last region's end)."""
        return self.regions[-1].offset + self.regions[-1].nbytes

    @property
    def first_parameter(self) -> str:
        return self.regions[0].param_name

    def accepts(self, tensors: Mapping[str, "torch.Tensor"]) -> bool:
        """The inputs have the shapes and dtypes the plan was recorded with."""
        for name, (shape, dtype) in zip(self.inputs, self.input_specs):
            t = tensors.get(name)
            if t is None or tuple(t.shape) != shape or str(t.dtype) != dtype:
                return False
        return True

    def precheck(self) -> None:
        """ValueError unless every op names an input and a region of the group and has a sane shape
        (what compiling needs; the bounds are the native check's: program.py)."""
        if len(self.input_specs) != len(self.inputs) or len(self.itemsizes) != len(self.regions) or not self.regions:
            raise ValueError("plan inputs or regions do not match its group")
        for inp, reg, _d_off, _s_off, sizes, d_str, s_str in self.ops:
            if not (-1 <= inp < len(self.inputs) and 0 <= reg < len(self.regions)):
                raise ValueError("op names no input or region of its group")
            if not sizes or len(sizes) > MAX_DIMS or len(sizes) != len(d_str) or len(sizes) != len(s_str):
                raise ValueError("op has a malformed shape")
            if min(sizes) < 1 or min(d_str) < 0 or (inp >= 0 and min(s_str) < 0):
                raise ValueError("op has an empty dimension or a negative stride")

    def regions_at(self, offset: int) -> list[SlotRegion]:
        """The group's parameters as regions of a slot it was written into from ``offset``."""
        return [SlotRegion(r.param_name, offset + r.offset, r.nbytes) for r in self.regions]


def input_nbytes(specs: Sequence[tuple[Sequence[int], str]]) -> list[int]:
    """Bytes of each input as the plan recorded it (shape, dtype): what the native check bounds."""
    import math

    import torch

    out = []
    for shape, dtype in specs:
        kind = getattr(torch, dtype.removeprefix("torch."), None)
        if not isinstance(kind, torch.dtype):
            raise ValueError(f"unknown dtype {dtype}")
        out.append(math.prod(shape) * kind.itemsize)
    return out
