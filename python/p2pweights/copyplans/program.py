"""A copy plan compiled to a native copy program, checked once by the native core, and joined per slot.

:func:`byte_ops` turns a plan's ops of elements into copies of bytes (contiguous dimensions folded,
ops that continue each other joined); :func:`compile_program` turns those into 2-D byte copies: an
``(n, 7)`` int64 array (input or -1 for a zero fill, dst offset from the group's start, src offset
from the input's start, row bytes, rows, dst pitch, src pitch; csrc/buffers/copy_program.h). Ops of
3-4 dimensions enumerate their outer dimensions; an op whose innermost dimension is strided (1-byte
elements) becomes rows of one element.

:func:`program_of` compiles a plan once and has the native core check it (``check_copy_program``):
every descriptor inside the group's bytes and its input's bytes, and no two descriptors writing one
byte (plans load from disk; overlapping writes would race in the batched kernel). That is the one
bounds check: a plan that fails it is refused (:class:`PlanRefused`), and the native run calls
apply the same check to the joined program of a slot before writing anything.

:func:`slot_program` joins the programs of the groups one slot holds (cached per placement): one
native call fills the slot, since a call per group costs ~15 us of Python, which bounded a GPU slot
at ~500 GB/s on the H200.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

from .. import _native
from ..replica.groups import SlotRegion
from .group_plan import GroupPlan, Op, input_nbytes

if TYPE_CHECKING:
    import numpy as np

# one byte op: (input index or -1 for a zero fill, 1, dst byte offset from the group's start, src
# byte offset from the input's start, sizes, dst strides, src strides), sizes and strides in bytes
ByteOp = tuple[int, int, int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]
COLUMNS = 7
MAX_DESCRIPTORS = 1 << 16  # per group; a plan this fragmented is refused (its group keeps the loaders)


class PlanRefused(ValueError):
    """A plan that cannot be compiled, or that the native check refused (why)."""


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


def _to_bytes(op: Op, regions: Sequence[SlotRegion], itemsizes: Sequence[int]) -> ByteOp:
    inp, reg, d_off, s_off, sizes, d_str, s_str = op
    size = itemsizes[reg]
    strides = [[x * size for x in d_str] + [1]] + ([[x * size for x in s_str] + [1]] if inp >= 0 else [])
    shape, strides = _collapse(list(sizes) + [size], strides)
    s_strides = strides[1] if inp >= 0 else [0] * len(shape)
    return (inp, 1, regions[reg].offset + d_off * size, s_off * size if inp >= 0 else 0,
            tuple(shape), tuple(strides[0]), tuple(s_strides))



def byte_ops(ops: Sequence[Op], regions: Sequence[SlotRegion], itemsizes: Sequence[int]) -> list[ByteOp]:
    """Ops as copies of bytes (width 1): contiguous dimensions folded, ops that continue each other
    (same input, both sides adjacent) joined: what :func:`compile_program` turns into descriptors."""
    out: list[ByteOp] = []
    for op in ops:
        b = _to_bytes(op, regions, itemsizes)
        if out and len(b[4]) == 1 and len(out[-1][4]) == 1 and b[5] == (1,) and out[-1][5] == (1,):
            p = out[-1]
            if p[0] == b[0] and p[2] + p[4][0] == b[2] and (b[0] < 0 or (p[6] == b[6] == (1,) and p[3] + p[4][0] == b[3])):
                out[-1] = (p[0], 1, p[2], p[3], (p[4][0] + b[4][0],), p[5], p[6])
                continue
        out.append(b)
    return out


def compile_program(ops: Sequence[ByteOp], limit: int | None = None) -> "np.ndarray | None":
    """Byte ops as 2-D copy descriptors, or None past ``limit`` (:data:`MAX_DESCRIPTORS`)."""
    import numpy as np

    limit = MAX_DESCRIPTORS if limit is None else limit
    rows: list[tuple[int, ...]] = []
    for inp, _width, d_off, s_off, sizes, d_str, s_str in ops:
        if d_str[-1] == 1 and (inp < 0 or s_str[-1] == 1):
            row, outer, d_out, s_out = sizes[-1], sizes[:-1], d_str[:-1], s_str[:-1]
        else:  # the innermost dimension is strided (1-byte elements): rows of one element
            row, outer, d_out, s_out = 1, sizes, d_str, s_str
        if outer:
            count, d_pitch, s_pitch = outer[-1], d_out[-1], s_out[-1]
            outer, d_out, s_out = outer[:-1], d_out[:-1], s_out[:-1]
        else:
            count, d_pitch, s_pitch = 1, row, row
        if inp < 0:
            s_off, s_pitch, s_out = 0, 0, (0,) * len(outer)
        if len(rows) + math.prod(outer) > limit:
            return None
        for index in itertools.product(*(range(n) for n in outer)):
            rows.append((inp, d_off + sum(i * st for i, st in zip(index, d_out)),
                         s_off + sum(i * st for i, st in zip(index, s_out)), row, count, d_pitch, s_pitch))
    program = np.array(rows, dtype=np.int64).reshape(-1, COLUMNS)
    program.flags.writeable = False  # read by native threads with the GIL released
    return program


def program_of(plan: GroupPlan) -> "np.ndarray":
    """The plan's program: compiled and checked by the native core on first use, cached on the plan.
    :class:`PlanRefused` when the plan is malformed, too fragmented, or fails the native check."""
    if plan._program is None:
        try:
            plan.precheck()
            program = compile_program(byte_ops(plan.ops, plan.regions, plan.itemsizes))
            if program is None:
                raise PlanRefused(f"more than {MAX_DESCRIPTORS} copies")
            code, message = _native.check_copy_program(program, plan.group_bytes, input_nbytes(plan.input_specs))
            if code != int(_native.Code.OK):
                raise PlanRefused(message)
        except (ValueError, OverflowError) as e:
            plan._program = PlanRefused(f"the copy plan of group {plan.group_index} ({plan.first_parameter}): {e}")
        else:
            plan._program = program
    if isinstance(plan._program, PlanRefused):
        raise plan._program
    return plan._program


@dataclass
class SlotProgram:
    """The programs of the groups one slot holds, joined: one native call fills the slot."""

    plans: tuple[GroupPlan, ...]  # kept: the cache key holds their ids
    program: "np.ndarray"
    inputs: tuple[str, ...]  # HF names, in the order the joined program indexes them
    # (offset, nbytes) -> the descriptors writing into those bytes and their inputs' indices
    # (replay.DeferredReplay.piece): a steady update asks for the same ranges every time
    pieces: dict = field(default_factory=dict, repr=False, compare=False)


class SlotPrograms:
    """Joined programs per placement ((plan, offset) pairs), the oldest dropped past ``limit``
    (a steady-state update reuses one per slot placement)."""

    def __init__(self, limit: int = 256):
        self.limit = limit
        self._joined: dict[tuple, SlotProgram] = {}

    def __len__(self) -> int:
        return len(self._joined)

    def joined(self, placed: Sequence[tuple[GroupPlan, int]]) -> SlotProgram:
        import numpy as np

        key = tuple((id(p), off) for p, off in placed)
        cached = self._joined.get(key)
        if cached is not None and all(a is b for a, b in zip(cached.plans, (p for p, _ in placed))):
            return cached
        parts, names = [], []
        for plan, offset in placed:
            rows = program_of(plan).copy()  # checked inside the group's bytes: shifting keeps it in its place
            rows[:, 0] = np.where(rows[:, 0] >= 0, rows[:, 0] + len(names), -1)
            rows[:, 1] += offset
            parts.append(rows)
            names.extend(plan.inputs)
        joined = np.concatenate(parts) if parts else np.zeros((0, COLUMNS), dtype=np.int64)
        joined.flags.writeable = False
        if len(self._joined) >= self.limit:
            self._joined.pop(next(iter(self._joined)))
        made = self._joined[key] = SlotProgram(tuple(p for p, _ in placed), joined, tuple(names))
        return made
