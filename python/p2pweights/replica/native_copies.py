"""Recorded copy plans replayed by the native core: one call per group, no per-op Python or torch.

A plan's byte copies (:func:`~p2pweights.replica.byte_copies.byte_ops`: contiguous dimensions
folded, continuing ops joined) are compiled once into a program of 2-D byte copies (an ``(n, 7)``
int64 array cached on the plan: input or -1 for a zero fill, dst offset from the group's start,
src offset from the input's start, row bytes, rows, dst pitch, src pitch; csrc/buffers/
copy_program.h). Ops of 3-4 dimensions enumerate their outer dimensions; an op whose innermost
dimension is strided (1-byte elements) becomes rows of one element. The native core checks every
descriptor against the group's bytes and each input's bytes on every call (a plan from disk is
untrusted) and writes nothing when one reaches outside: :class:`LayoutMismatch` naming the group.

The producer joins the programs of every replayed group of a slot (:func:`replay_slot`, cached
per placement): one native call per slot, since a call per group costs ~15 us of Python, which
bounded a GPU slot at ~500 GB/s on the H200.

Which path runs where (:func:`replay_natively`; ``False`` leaves the group to the torch views):

- host slot, host inputs: memcpy/memset split by bytes across ``P2PW_COPY_THREADS`` threads,
  the GIL released;
- GPU slot, inputs on its device, the module built with nvcc (``cuda_driver_info()["kernel"]``):
  the batched copy kernel (csrc/kernels/copy_batch.cu), one launch per 64 copies on torch's
  current stream, each copy cut into 64 KiB chunks copied in the widest unit its addresses allow —
  a GPU runs thousands of small driver copies a few us apart, a kernel's blocks side by side
  (``cuda_mode = "kernel"``, the default; a failure switches the process to the driver copies);
- else: CUDA driver copies enqueued on torch's current stream of that
  device (the fillers' event after the producers still orders them), one cuMemcpyAsync per 1-D
  copy (``cuda_mode = "each"``) or one cuMemcpyBatchAsync for all of them (``"batch"``), 2-D
  copies cuMemcpy2DAsync; spread over ``P2PW_COPY_LANES`` side streams forked from and joined
  back to that stream by events (a GPU runs one stream's copies one after another, a few us
  apart: 8 lanes gave 1.3x on a Qwen3-4B TP2 slot, nothing on Qwen3-30B EP8's ~2,700 copies). No
  driver, or a driver call that failed: native CUDA copies are off for
  the process (:data:`state`) and GPU slots keep the element views;
- anything else (inputs on another device than the slot, an input that is not contiguous, a plan
  of more than :data:`MAX_DESCRIPTORS` copies, no native module): the torch views.
"""
from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from .. import settings
from ..errors import LayoutMismatch
from .byte_copies import WideOp, byte_ops

if TYPE_CHECKING:
    import numpy as np
    import torch

logger = logging.getLogger("p2pweights.replica")

COLUMNS = 7
MAX_DESCRIPTORS = 1 << 16  # per group; a plan this fragmented keeps the torch views
CUDA_MODES = ("kernel", "each", "batch")
_OK, _NOT_FOUND, _DRIVER_FAILED = 0, -6, -4  # csrc/status.h codes the edge tells apart


@dataclass
class NativeCopyState:
    """The process's native replay: the CUDA mode, why CUDA copies are off, and what ran."""

    cuda_mode: str = "kernel"  # "kernel" | "each" | "batch" (benchmarks/bench_replay.py measures each)
    kernel_off: str | None = None  # set once the batched copy kernel failed: "each" from then on
    cuda_off: str | None = None  # set once the driver is missing or a call failed
    batch_off: str | None = None  # set once a batch call failed: "batch" runs as "each" from then on
    lanes_off: str | None = None  # set once copies on several streams failed: one stream from then on
    host_groups: int = 0
    cuda_groups: int = 0
    driver_calls: int = 0


state = NativeCopyState()


def compile_program(ops: Sequence[WideOp], limit: int | None = None) -> "np.ndarray | None":
    """Byte ops (width 1) as 2-D copy descriptors, or None past ``limit`` (:data:`MAX_DESCRIPTORS`)."""
    import numpy as np

    limit = MAX_DESCRIPTORS if limit is None else limit
    rows: list[tuple[int, ...]] = []
    for inp, width, d_off, s_off, sizes, d_str, s_str in ops:
        if width != 1:
            raise ValueError("copy programs are compiled from byte ops (width 1)")
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


def program_of(plan: Any) -> "np.ndarray | None":
    """The plan's program (compiled on first use, cached on the plan like its wide ops)."""
    if plan._program is None:
        program = compile_program(byte_ops(plan.ops, plan.regions, plan.itemsizes))
        plan._program = False if program is None else program
    return None if plan._program is False else plan._program


def _native() -> Any:
    try:
        from .. import _native
    except ImportError:
        return None
    return _native if hasattr(_native, "run_copy_program_host") else None


def cuda_available() -> tuple[bool, str]:
    """Whether GPU slots can take the native copies here, and if not why."""
    native = _native()
    if native is None:
        return False, "the native module has no copy programs (rebuild it)"
    if state.cuda_off:
        return False, state.cuda_off
    info = native.cuda_driver_info()
    return bool(info["loaded"]), str(info["error"])


def _usable(slot: "torch.Tensor", inputs: Sequence["torch.Tensor"]) -> Any:
    """The native module if these tensors can take the native copies, else None."""
    import torch

    device = slot.device
    if device.type not in ("cpu", "cuda") or (device.type == "cuda" and state.cuda_off):
        return None
    if slot.dtype != torch.uint8 or not slot.is_contiguous():
        return None
    if any(t.device != device or not t.is_contiguous() for t in inputs):
        return None
    return _native()


def replay_natively(plan: Any, inputs: Sequence["torch.Tensor"], slot: "torch.Tensor", offset: int,
                    threads: int | None = None, mode: str | None = None) -> bool:
    """Write the group's bytes into ``slot`` from ``offset`` with the native core; False (nothing
    written) where it cannot, and the caller takes the torch views. ``threads``/``mode`` override
    ``P2PW_COPY_THREADS``/``state.cuda_mode`` (tests, the benchmark)."""
    native = _usable(slot, inputs)
    if native is None:
        return False
    program = program_of(plan)
    if program is None:
        return False
    args = (program, slot.data_ptr() + offset, plan.group_bytes, [t.data_ptr() for t in inputs],
            [t.numel() * t.element_size() for t in inputs])
    return _run(native, args, slot.device, 1, plan.group_index, plan.regions[0].param_name, threads, mode)


@dataclass
class SlotProgram:
    """The programs of the groups one slot holds, joined: one native call fills the slot."""

    plans: tuple[Any, ...]  # kept: the cache key holds their ids
    program: "np.ndarray"
    inputs: tuple[str, ...]  # HF names, in the order the joined program indexes them


SLOT_PROGRAMS = 256  # joined programs kept (a steady-state update reuses one per slot placement)
_slot_programs: "dict[tuple, SlotProgram]" = {}


def slot_program(placed: Sequence[tuple[Any, int]]) -> SlotProgram | None:
    """The joined program of ``(plan, offset)`` pairs (cached per placement), or None when a plan
    has no program. Each group's descriptors are checked to stay inside its own bytes here, once
    (the native core then checks the joined program against the whole slot on every call)."""
    import numpy as np

    key = tuple((id(p), off) for p, off in placed)
    cached = _slot_programs.get(key)
    if cached is not None and all(a is b for a, b in zip(cached.plans, (p for p, _ in placed))):
        return cached
    parts, names = [], []
    for plan, offset in placed:
        program = program_of(plan)
        if program is None:
            return None
        rows = program.copy()
        if len(rows):
            end = rows[:, 1] + (rows[:, 4] - 1) * rows[:, 5] + rows[:, 3]
            if (rows[:, 1] < 0).any() or (end > plan.group_bytes).any():
                raise LayoutMismatch(
                    f"the copy plan of group {plan.group_index} writes outside its {plan.group_bytes} bytes",
                    parameter=plan.regions[0].param_name,
                    hint="the plan (from P2PW_REPLICA_CACHE_DIR?) is damaged: delete it and it is recorded again")
            rows[:, 0] = np.where(rows[:, 0] >= 0, rows[:, 0] + len(names), -1)
            rows[:, 1] += offset
        parts.append(rows)
        names.extend(plan.inputs)
    joined = np.concatenate(parts) if parts else np.zeros((0, COLUMNS), dtype=np.int64)
    joined.flags.writeable = False
    if len(_slot_programs) >= SLOT_PROGRAMS:
        _slot_programs.pop(next(iter(_slot_programs)))
    made = _slot_programs[key] = SlotProgram(tuple(p for p, _ in placed), joined, tuple(names))
    return made


def replay_slot(placed: Sequence[tuple[Any, int]], tensors: Any, slot: "torch.Tensor",
                threads: int | None = None, mode: str | None = None, lanes: int | None = None) -> bool:
    """Every ``(plan, offset)`` group into ``slot`` in one native call; False (nothing written)
    where the native copies cannot take them all, and the caller replays group by group."""
    if not placed:
        return True
    joined = slot_program(placed)
    if joined is None:
        return False
    native = _usable(slot, ())
    if native is None:
        return False
    # one pass over the slot's inputs (thousands for an MoE rank: ~1 us of Python each is what
    # the producer adds to the copies): same device as the slot, contiguous, address and size
    on_host, device = slot.device.type == "cpu", slot.get_device()
    addrs, sizes = [], []
    for name in joined.inputs:
        t = tensors[name]
        if not (t.is_cpu if on_host else t.get_device() == device) or not t.is_contiguous():
            return False
        addrs.append(t.data_ptr())
        sizes.append(t.nbytes)
    args = (joined.program, slot.data_ptr(), slot.numel(), addrs, sizes)
    first = placed[0][0]
    return _run(native, args, slot.device, len(placed), first.group_index, first.regions[0].param_name,
                threads, mode, lanes)


def _run(native: Any, args: tuple, device: "torch.device", groups: int, group_index: int, parameter: str,
         threads: int | None, mode: str | None, lanes: int | None = None) -> bool:
    import torch

    if device.type == "cuda":
        stream = torch.cuda.current_stream(device).cuda_stream
        wanted = mode or state.cuda_mode
        if wanted not in CUDA_MODES:
            raise ValueError(f"native CUDA copy mode {wanted!r}: use one of {', '.join(CUDA_MODES)}")
        use = "each" if (wanted == "batch" and state.batch_off) or (wanted == "kernel" and state.kernel_off) else wanted
        lanes = lanes if lanes is not None else (1 if state.lanes_off else settings.value("P2PW_COPY_LANES"))
        code, message, calls = native.run_copy_program_cuda(*args, stream, use, lanes)
        if code == _DRIVER_FAILED and use == "kernel":  # loading or launching the kernel: driver copies
            state.kernel_off = message
            logger.warning("the batched copy kernel failed (%s): native CUDA copies use driver copies", message)
            use = "each"
            code, message, calls = native.run_copy_program_cuda(*args, stream, use, lanes)
        if code == _DRIVER_FAILED and use == "batch":  # the newest driver call: keep the proven ones
            state.batch_off = message
            logger.warning("cuMemcpyBatchAsync failed (%s): native CUDA copies use one call per copy", message)
            code, message, calls = native.run_copy_program_cuda(*args, stream, "each", lanes)
        if code == _DRIVER_FAILED and lanes > 1:  # then the lanes (streams and events)
            state.lanes_off = message
            logger.warning("native CUDA copies on %d streams failed (%s): the caller's stream only", lanes, message)
            code, message, calls = native.run_copy_program_cuda(*args, stream, "each", 1)
        if code in (_NOT_FOUND, _DRIVER_FAILED):
            state.cuda_off = message
            log = logger.info if code == _NOT_FOUND else logger.warning
            log("native CUDA copies are off in this process (%s): GPU slots replay element views", message)
            return False  # the fallback rewrites every byte of the group
        state.cuda_groups += groups if code == _OK else 0
        state.driver_calls += calls
    else:
        count = threads if threads is not None else settings.value("P2PW_COPY_THREADS")
        code, message = native.run_copy_program_host(*args, count)
        state.host_groups += groups if code == _OK else 0
    if code != _OK:
        what = f"group {group_index}" if groups == 1 else f"the {groups} groups from group {group_index}"
        raise LayoutMismatch(
            f"the copy plan of {what} does not fit its slot or inputs: {message}",
            parameter=parameter,
            hint="the plan (from P2PW_REPLICA_CACHE_DIR?) is damaged: delete it and it is recorded again")
    return True
