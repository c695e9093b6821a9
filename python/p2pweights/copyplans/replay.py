"""Replaying copy plans into a slot, with the fallback order as an explicit object.

:class:`ReplayOrder` holds, per device kind, the paths to try in order and which of them turned
off in its lifetime (and why). A sender owns one (its settings' threads and lanes); a benchmark
row or a test makes its own. Nothing here is process-global.

The paths (benchmarks/RESULTS.md, "Slot production: who issues the copies", measured on the H200):

- ``native host``: host slot, host inputs: memcpy/memset split by bytes across ``threads``
  threads, the GIL released.
- ``kernel``: GPU slot, inputs on its device, the module built with nvcc: the batched copy kernel
  (csrc/kernels/copy_batch.cu), one launch per 64 copies on torch's current stream (1,920 / 1,773
  GB/s against a 2,050 GB/s ceiling).
- ``driver copies``: one CUDA driver copy per descriptor, spread over ``lanes`` side streams forked
  from and joined back to the current stream (8 lanes: 1.3x one stream on a Qwen3-4B TP2 slot). A
  failure with several lanes retries on one stream and turns the lanes off.
- ``element views``: torch views of each region's element size in one ``_foreach_copy_`` per group:
  any device, any input placement; the last resort.

A slot whose inputs the native paths cannot take (another device, not contiguous) goes to the
element views for that call only. A native path that fails at the driver (no driver: NOT_FOUND;
a failed call: DEVICE_ERROR) is turned off for this order and the next path runs; nothing of the
slot is trusted from the failed call (the next path rewrites every byte). A native check failure
(a program outside its slot or inputs) is a damaged plan: :class:`~p2pweights.errors.LayoutMismatch`.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Mapping, Sequence

from .. import _native, settings
from ..errors import LayoutMismatch
from ..replica.groups import SLOT_ALIGNMENT, SlotRegion
from .element_views import run_element_ops
from .group_plan import GroupPlan
from .program import PlanRefused, SlotProgram, SlotPrograms

if TYPE_CHECKING:
    import numpy as np
    import torch

logger = logging.getLogger("p2pweights.copyplans")

_DAMAGED_HINT = "the plan (from P2PW_REPLICA_CACHE_DIR?) is damaged: delete it and it is recorded again"


class ReplayPath(str, Enum):
    NATIVE_HOST = "native host"
    KERNEL = "kernel"
    DRIVER_COPIES = "driver copies"
    ELEMENT_VIEWS = "element views"


HOST_ORDER = (ReplayPath.NATIVE_HOST, ReplayPath.ELEMENT_VIEWS)
GPU_ORDER = (ReplayPath.KERNEL, ReplayPath.DRIVER_COPIES, ReplayPath.ELEMENT_VIEWS)
_NATIVE_MODE = {ReplayPath.KERNEL: "kernel", ReplayPath.DRIVER_COPIES: "each"}


@dataclass
class ReplayOrder:
    """Which path replays a slot's plans, tried in order, and what turned a path off (see the module).

    ``threads``/``lanes``: None reads ``P2PW_COPY_THREADS``/``P2PW_COPY_LANES`` at each call.
    """

    host: tuple[ReplayPath, ...] = HOST_ORDER
    gpu: tuple[ReplayPath, ...] = GPU_ORDER
    threads: int | None = None
    lanes: int | None = None
    off: dict[ReplayPath, str] = field(default_factory=dict)  # path -> why it is off
    lanes_off: str | None = None  # several streams failed once: one stream from then on
    groups: dict[ReplayPath, int] = field(default_factory=dict)  # groups each path replayed
    driver_calls: int = 0
    programs: SlotPrograms = field(default_factory=SlotPrograms, repr=False)

    def __post_init__(self) -> None:
        if not self.host or self.host[-1] is not ReplayPath.ELEMENT_VIEWS:
            raise ValueError("a host order ends with the element views (the path that takes any slot)")
        if not self.gpu or self.gpu[-1] is not ReplayPath.ELEMENT_VIEWS:
            raise ValueError("a GPU order ends with the element views (the path that takes any slot)")
        if set(self.host) - set(HOST_ORDER) or set(self.gpu) - set(GPU_ORDER):
            raise ValueError(f"host paths: {[p.value for p in HOST_ORDER]}; GPU paths: {[p.value for p in GPU_ORDER]}")

    def paths(self, device: "torch.device") -> list[ReplayPath]:
        """The paths still on for slots on ``device``, in order."""
        order = self.gpu if device.type == "cuda" else self.host
        return [p for p in order if p not in self.off]

    def replay(self, plan: GroupPlan, tensors: Mapping[str, "torch.Tensor"], slot: "torch.Tensor",
               offset: int) -> list[SlotRegion]:
        """One group into ``slot`` from ``offset``."""
        return self.replay_slot([(plan, offset)], tensors, slot)

    def replay_slot(self, placed: Sequence[tuple[GroupPlan, int]], tensors: Mapping[str, "torch.Tensor"],
                    slot: "torch.Tensor") -> list[SlotRegion]:
        """Every ``(plan, offset)`` group into ``slot``; the regions written, in order."""
        if not placed:
            return []
        for plan, offset in placed:
            if offset % SLOT_ALIGNMENT or offset < 0 or slot.numel() < offset + plan.group_bytes:
                raise LayoutMismatch(f"group {plan.group_index} does not fit in a slot of {slot.numel()} bytes at {offset}",
                                     parameter=plan.first_parameter)
        try:
            joined = self.programs.joined(placed)
        except PlanRefused as e:
            raise LayoutMismatch(str(e), parameter=placed[0][0].first_parameter, hint=_DAMAGED_HINT) from None
        args = self._native_args(joined, tensors, slot)
        for path in self.paths(slot.device):
            if path in self.off:  # turned off by the path before (no driver: every native GPU path)
                continue
            if path is ReplayPath.ELEMENT_VIEWS or (args is not None and self._native(path, placed, args, slot)):
                break
        if path is ReplayPath.ELEMENT_VIEWS:
            for plan, offset in placed:
                inputs = [t if t.is_contiguous() else t.contiguous() for t in (tensors[n] for n in plan.inputs)]
                run_element_ops(plan.ops, plan.regions, plan.itemsizes, inputs, slot[offset:])
        self.groups[path] = self.groups.get(path, 0) + len(placed)
        return [r for plan, offset in placed for r in plan.regions_at(offset)]

    def defer_slot(self, placed: Sequence[tuple[GroupPlan, int]], tensors: Mapping[str, "torch.Tensor"],
                   slot: "torch.Tensor") -> "DeferredReplay | None":
        """The host slot's replay not run now: a :class:`DeferredReplay` that compares each parameter's
        range with its base straight from ``tensors`` (which must stay alive until it is used) and
        writes into ``slot`` only the ranges asked for; None where the native host path cannot take
        this slot (the caller replays it now)."""
        if not placed or slot.device.type != "cpu" or ReplayPath.NATIVE_HOST not in self.paths(slot.device):
            return None
        for plan, offset in placed:
            if offset % SLOT_ALIGNMENT or offset < 0 or slot.numel() < offset + plan.group_bytes:
                return None  # replay_slot names the misfit
        try:
            joined = self.programs.joined(placed)
        except PlanRefused:
            return None
        args = self._native_args(joined, tensors, slot)
        if args is None:
            return None
        self.groups[ReplayPath.NATIVE_HOST] = self.groups.get(ReplayPath.NATIVE_HOST, 0) + len(placed)
        threads = self.threads if self.threads is not None else settings.value("P2PW_COPY_THREADS")
        return DeferredReplay(placed, joined, [tensors[n] for n in joined.inputs], *args, threads)

    @staticmethod
    def _native_args(joined, tensors, slot) -> tuple | None:
        """The native call's arguments, or None where the native copies cannot take this slot: a
        slot that is not contiguous bytes, an input on another device or not contiguous."""
        import torch

        if slot.dtype != torch.uint8 or not slot.is_contiguous() or slot.device.type not in ("cpu", "cuda"):
            return None
        # one pass over the slot's inputs (thousands for an MoE rank: ~1 us of Python each is what
        # the producer adds to the copies): same device as the slot, contiguous, address and size
        on_host, device = slot.device.type == "cpu", slot.get_device()
        addrs, sizes = [], []
        for name in joined.inputs:
            t = tensors[name]
            if not (t.is_cpu if on_host else t.get_device() == device) or not t.is_contiguous():
                return None
            addrs.append(t.data_ptr())
            sizes.append(t.nbytes)
        return (joined.program, slot.data_ptr(), slot.numel(), addrs, sizes)

    def _native(self, path: ReplayPath, placed, args: tuple, slot) -> bool:
        """Run the joined program on ``path``; False where the path turned off (the caller tries the
        next path)."""
        import torch

        if path is ReplayPath.NATIVE_HOST:
            threads = self.threads if self.threads is not None else settings.value("P2PW_COPY_THREADS")
            code, message = _native.run_copy_program_host(*args, threads)
        else:
            stream = torch.cuda.current_stream(slot.device).cuda_stream
            lanes = 1 if self.lanes_off else (self.lanes if self.lanes is not None else settings.value("P2PW_COPY_LANES"))
            code, message, calls = _native.run_copy_program_cuda(*args, stream, _NATIVE_MODE[path], lanes)
            if code == _DEVICE_ERROR and path is ReplayPath.DRIVER_COPIES and lanes > 1:
                self.lanes_off = message  # the streams and events first: the proven one-stream copies next
                logger.warning("native CUDA copies on %d streams failed (%s): the caller's stream only", lanes, message)
                code, message, calls = _native.run_copy_program_cuda(*args, stream, "each", 1)
            self.driver_calls += calls
        if code in (_NOT_FOUND, _DEVICE_ERROR):
            self._turn_off(path, code, message)
            return False
        if code != _OK:
            first = placed[0][0]
            what = (f"group {first.group_index}" if len(placed) == 1
                    else f"the {len(placed)} groups from group {first.group_index}")
            raise LayoutMismatch(f"the copy plan of {what} does not fit its slot or inputs: {message}",
                                 parameter=first.first_parameter, hint=_DAMAGED_HINT)
        return True

    def _turn_off(self, path: ReplayPath, code: int, message: str) -> None:
        if code == _NOT_FOUND and path is not ReplayPath.NATIVE_HOST:  # no driver: no native GPU path at all
            for p in (ReplayPath.KERNEL, ReplayPath.DRIVER_COPIES):
                self.off[p] = message
        else:
            self.off[path] = message
        nxt = [p.value for p in self.paths_after(path)]
        (logger.info if code == _NOT_FOUND else logger.warning)(
            "copy-plan replay: %s is off (%s): %s from now on", path.value, message, nxt[0] if nxt else "nothing")

    def paths_after(self, path: ReplayPath) -> list[ReplayPath]:
        order = self.host if path is ReplayPath.NATIVE_HOST else self.gpu
        return [p for p in order[order.index(path) + 1:] if p not in self.off]

    def summary(self) -> dict[str, object]:
        """What replayed what, and what is off and why (the report's and doctor's view)."""
        return {"groups": {p.value: n for p, n in self.groups.items()},
                "off": {p.value: why for p, why in self.off.items()},
                "lanes_off": self.lanes_off, "driver_calls": self.driver_calls}


class DeferredReplay:
    """A host slot's joined copy program not run yet (:meth:`ReplayOrder.defer_slot`): per parameter
    range, the descriptors that write into it (their inputs renumbered), to compare with a base
    straight from the inputs (``_native.delta_encode_program``: the slot's bytes never made) or to
    run into the slot when the range's bytes are needed there (:meth:`run`). Holds the inputs."""

    def __init__(self, placed, joined: SlotProgram, inputs: list, program: "np.ndarray", slot: int, slot_bytes: int,
                 addrs: list[int], sizes: list[int], threads: int):
        self.placed, self.joined, self.inputs = placed, joined, inputs  # inputs: kept alive while deferred
        self.program, self.slot, self.slot_bytes, self.threads = program, slot, slot_bytes, threads
        self._addrs, self._sizes = addrs, sizes
        self._by_start: tuple | None = None  # the descriptors by destination start, made on a piece's first use
        self.encoded = 0  # ranges compared from the inputs
        self.ran = 0  # ranges run into the slot

    def piece(self, offset: int, nbytes: int) -> tuple["np.ndarray", list[int], list[int]]:
        """The descriptors writing into bytes [offset, offset + nbytes) of the slot, their inputs
        renumbered from 0: (program, input addresses, input sizes). Kept with the joined program."""
        got = self.joined.pieces.get((offset, nbytes))
        if got is None:
            got = self.joined.pieces[(offset, nbytes)] = self._select(offset, nbytes)
        sub, used = got
        return sub, [self._addrs[k] for k in used], [self._sizes[k] for k in used]

    def _select(self, offset: int, nbytes: int) -> tuple["np.ndarray", list[int]]:
        import numpy as np

        if self._by_start is None:
            program = self.program
            lo = program[:, 1]
            hi = lo + (program[:, 4] - 1) * program[:, 5] + program[:, 3]
            order = np.argsort(lo, kind="stable")
            ends = hi[order]
            reach = np.maximum.accumulate(ends) if len(ends) else ends  # the furthest end so far, by start
            self._by_start = (order, lo[order], ends, reach)
        order, starts, ends, reach = self._by_start
        i = int(np.searchsorted(reach, offset, side="right"))
        j = int(np.searchsorted(starts, offset + nbytes, side="left"))
        sub = self.program[np.sort(order[i:j][ends[i:j] > offset])]
        used, index = np.unique(sub[:, 0], return_inverse=True)
        fills = int((used < 0).sum())  # -1 sorts first: zero fills keep -1, inputs count from 0
        sub[:, 0] = np.where(sub[:, 0] < 0, -1, index.reshape(-1) - fills)
        sub.flags.writeable = False
        return sub, used[fills:].tolist()

    def encode(self, offset: int, nbytes: int, base: "np.ndarray", unit: int, out: "np.ndarray",
               threads: int) -> tuple | None:
        """``_native.delta_encode_program`` of the range against ``base`` (updated) into ``out``:
        (encoded bytes, changed bytes, runs, mode), or None where the program leaves a byte of the
        range unwritten (nothing read or written: :meth:`run` it and encode the slot)."""
        program, addrs, sizes = self.piece(offset, nbytes)
        code, message, n, changed, runs, mode = _native.delta_encode_program(
            program, self.slot_bytes, addrs, sizes, offset, nbytes, int(base.ctypes.data), unit,
            int(out.ctypes.data), int(out.nbytes), threads)
        if code == _NOT_FOUND:
            return None
        if code != _OK:
            raise LayoutMismatch(f"the copy program of the slot's bytes from {offset} cannot be compared: {message}",
                                 parameter=self.placed[0][0].first_parameter, hint=_DAMAGED_HINT)
        self.encoded += 1
        return n, changed, runs, mode

    def run(self, offset: int, nbytes: int) -> None:
        """Write the range's bytes into the slot (the descriptors writing into it, whole)."""
        program, addrs, sizes = self.piece(offset, nbytes)
        code, message = _native.run_copy_program_host(program, self.slot, self.slot_bytes, addrs, sizes, self.threads)
        if code != _OK:
            raise LayoutMismatch(f"the copy program of the slot's bytes from {offset} does not fit: {message}",
                                 parameter=self.placed[0][0].first_parameter, hint=_DAMAGED_HINT)
        self.ran += 1


def cuda_copies_available() -> tuple[bool, str]:
    """Whether GPU slots can take native copies on this machine, and if not why (doctor)."""
    info = _native.cuda_driver_info()
    return bool(info["loaded"]), str(info["error"])


_OK = int(_native.Code.OK)
_NOT_FOUND = int(_native.Code.NOT_FOUND)
_DEVICE_ERROR = int(_native.Code.DEVICE_ERROR)
