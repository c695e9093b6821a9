"""The group stager: holds pushed HF tensors until every HF input of a parameter group arrived.

A parameter group is a connected component of HF names and parameters (q/k/v -> qkv_proj,
gate/up -> gate_up_proj, every expert of a layer -> w13/w2). Loading a group before all of its
inputs are here would write half-loaded bytes, so nothing is released for an incomplete group.
Sender memory stays bounded by the inputs of groups still incomplete (invariant 6).

FP8 engines: a group's HF names are the engine checkpoint's, where each quantized weight is
float8_e4m3fn with a ``weight_scale_inv`` (models/quant.py). The trainer sends either the weight in
BF16/FP16/FP32 alone (the quantize-on-send transform, quantize.py, makes the pair) or the
pre-quantized pair (float8_e4m3fn weight + its float32 scale, passed through). So a scale is an
optional input: the group is complete when every other input arrived and every FP8 weight has its
scale; a scale next to a BF16 weight, a weight of another dtype, or an FP8 weight without its scale
at finish is refused naming the tensor. Without FP8 weights in ``specs`` nothing of this applies.
"""
from __future__ import annotations

import difflib
from typing import Any, Iterable, Mapping, Sequence

from ..errors import LayoutMismatch, MissingTensors, P2PWeightsError, UnknownParameter, UnsupportedTensor
from ..models.quant import FP8_DTYPE
from .fp8 import TRAINER_DTYPES, quantized_pairs


class TensorSpecLike:  # documentation only: anything with .shape (tuple) and .dtype (str, e.g. "bfloat16")
    shape: tuple[int, ...]
    dtype: str


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


class GroupStager:
    """Stages HF tensors per parameter group.

    ``groups``: per group, the HF names it needs. ``specs``: HF name -> expected shape and dtype.
    ``expected``: the HF names this sender pushes in an update (e.g. its PP stage's); groups with no
    expected name are not waited for; a group partly inside ``expected`` is an error at build time.
    """

    def __init__(self, groups: Sequence[Sequence[str]], specs: Mapping[str, TensorSpecLike],
                 expected: Iterable[str] | None = None, *, where: str = ""):
        self._where = f" ({where})" if where else ""
        self._specs = specs
        self._group_of: dict[str, int] = {}
        for g, names in enumerate(groups):
            for n in names:
                self._group_of[n] = g
        self._inputs = [list(names) for names in groups]
        # FP8 engines: weight -> scale of each quantized pair; a scale is an optional input
        self._scale_of = quantized_pairs(specs)
        self._weight_of = {sc: w for w, sc in self._scale_of.items()}
        self._required = [[n for n in names if n not in self._weight_of] for names in groups]
        unknown = sorted(set(expected or ()) - set(specs))
        if unknown:
            raise UnknownParameter(self._unknown_message(unknown[0], len(unknown)))
        # Checkpoint names no group reads (another EP rank's experts, layers this engine rank does
        # not hold) are accepted and dropped: the trainer pushes the whole checkpoint.
        exp = set(self._group_of) if expected is None else set(expected) & set(self._group_of)
        self._active = sorted({self._group_of[n] for n in exp})
        self._active_set = frozenset(self._active)  # membership per push: O(1), not a scan
        for g in self._active:
            outside = [n for n in self._inputs[g] if n not in exp]
            if outside:
                raise P2PWeightsError(
                    f"parameter group of {self._inputs[g][0]!r}{self._where} needs {outside[0]!r}, which this "
                    f"sender does not push (expected names split a group across senders or PP stages)")
        self.bulk_table: Any = None  # bulk_push.PushTable of the prepared ranks this stager leads
        self.reset()

    @property
    def specs(self) -> Mapping[str, TensorSpecLike]:
        return self._specs

    @property
    def paired_names(self) -> frozenset[str]:
        """FP8 engines: every quantized weight and its scale (push() checks them as a pair)."""
        return frozenset(self._scale_of) | frozenset(self._weight_of)

    def reset(self) -> None:
        self._staged: dict[int, dict[str, Any]] = {}
        self._done: set[int] = set()
        self._pending: dict[int, int] = {}  # FP8 engines: see _complete
        self._held: dict[int, int] = {}  # bytes of each incomplete group's staged tensors
        self.held_bytes = 0  # of every incomplete group, now
        self.peak_held_bytes = 0  # the most at once in this update (the report's sender memory)

    @property
    def staged_bytes(self) -> int:
        return sum(int(t.numel()) * t.element_size() for g in self._staged.values() for t in g.values())

    def _unknown_message(self, name: str, count: int = 1) -> str:
        close = difflib.get_close_matches(name, list(self._specs), n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        more = f" (and {count - 1} more)" if count > 1 else ""
        return (f"HF tensor {name!r}{more} is loaded by no parameter of the target layout{self._where}{hint} "
                f"Push names as they appear in the HF checkpoint (model.safetensors.index.json).")

    def push(self, name: str, tensor: Any) -> tuple[int, dict[str, Any]] | None:
        """Stages one tensor; returns (group, {hf name: tensor}) when that completes its group."""
        spec = self._specs.get(name)
        if spec is None:
            raise UnknownParameter(self._unknown_message(name))
        if name in self._scale_of:
            self._check_quantized_weight(name, tensor, spec)
        elif tuple(tensor.shape) != tuple(spec.shape) or _dtype_name(tensor) != spec.dtype:
            raise LayoutMismatch(
                f"HF tensor {name!r}{self._where}: got shape {tuple(tensor.shape)} dtype {_dtype_name(tensor)}, "
                f"the engine's model expects shape {tuple(spec.shape)} dtype {spec.dtype} (push the full, "
                f"gathered tensor in the checkpoint's dtype)")
        g = self._group_of.get(name)
        if g is None:
            return None  # this engine rank loads nothing from it
        return self._stage(name, tensor, g)

    def stage_checked(self, name: str, tensor: Any) -> tuple[int, dict[str, Any]] | None:
        """:meth:`push` for a tensor whose name, shape, dtype and density the caller already checked
        against this stager's specs, and which is no member of an FP8 pair (the bulk push's table,
        bulk_push.py): only the group bookkeeping is left."""
        g = self._group_of.get(name)
        return None if g is None else self._stage(name, tensor, g)

    def _stage(self, name: str, tensor: Any, g: int) -> tuple[int, dict[str, Any]] | None:
        if g in self._done and name in self._weight_of:
            raise LayoutMismatch(
                f"HF tensor {name!r}{self._where} came after its parameter group was complete: pushed twice, or "
                f"with {self._weight_of[name]!r} in BF16 (quantized on send, which makes its own scale)",
                parameter=name, hint="push a scale only with its weight in float8_e4m3fn, once per update")
        if g in self._done or name in self._staged.get(g, {}):
            raise P2PWeightsError(f"HF tensor {name!r}{self._where} was pushed twice in one update")
        if g not in self._active_set:
            raise P2PWeightsError(f"HF tensor {name!r}{self._where} belongs to another sender's (PP stage's) parameters")
        staged = self._staged.setdefault(g, {})
        if self._scale_of:
            self._check_pair(name, tensor, staged)
        staged[name] = tensor
        nbytes = tensor.nbytes
        self._held[g] = self._held.get(g, 0) + nbytes
        self.held_bytes += nbytes
        self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        if not self._complete(g, name, staged):
            return None
        del self._staged[g]
        self.held_bytes -= self._held.pop(g)
        self._done.add(g)
        return g, staged

    # -- FP8 engines: a quantized weight comes in BF16 alone, or pre-quantized with its scale ----------
    def _complete(self, g: int, name: str, staged: Mapping[str, Any]) -> bool:
        """``name`` was just staged in group ``g``: is the group complete? (O(1) per push: a MoE
        layer's group has thousands of inputs.)"""
        if not self._scale_of:
            return len(staged) == len(self._inputs[g])
        # pending: required inputs not staged yet + FP8 weights staged without their scale
        pending = self._pending.get(g, len(self._required[g]))
        if name in self._weight_of:  # a scale: its FP8 weight (if staged) waits no more
            pending -= self._weight_of[name] in staged
        else:
            pending -= 1
            if name in self._scale_of and _is_fp8(staged[name]) and self._scale_of[name] not in staged:
                pending += 1
        self._pending[g] = pending
        return pending == 0

    def _check_quantized_weight(self, name: str, tensor: Any, spec: TensorSpecLike) -> None:
        dtype = _dtype_name(tensor)
        if tuple(tensor.shape) != tuple(spec.shape):
            raise LayoutMismatch(
                f"HF tensor {name!r}{self._where}: got shape {tuple(tensor.shape)}, the engine's model expects shape "
                f"{tuple(spec.shape)} (push the full, gathered tensor)", parameter=name)
        if dtype != FP8_DTYPE and dtype not in TRAINER_DTYPES:
            raise UnsupportedTensor(
                f"HF tensor {name!r}{self._where} is {dtype}: the engine holds it as {FP8_DTYPE} with a block scale; "
                f"push it in {', '.join(TRAINER_DTYPES)} (quantized on send) or as {FP8_DTYPE} together with "
                f"{self._scale_of[name]!r} (passed through)", parameter=name)

    def _check_pair(self, name: str, tensor: Any, staged: Mapping[str, Any]) -> None:
        """A scale goes with a pre-quantized (float8_e4m3fn) weight only, whichever comes first."""
        if name in self._weight_of and self._weight_of[name] in staged and not _is_fp8(staged[self._weight_of[name]]):
            weight, scale = self._weight_of[name], name
        elif name in self._scale_of and self._scale_of[name] in staged and not _is_fp8(tensor):
            weight, scale = name, self._scale_of[name]
        else:
            return
        raise LayoutMismatch(
            f"HF tensor {scale!r}{self._where} was pushed with {weight!r} in {_dtype_name(staged.get(weight, tensor))}: "
            f"a scale belongs to a pre-quantized {FP8_DTYPE} weight; a BF16 weight is quantized on send and makes "
            f"its own", parameter=scale,
            hint=f"push {weight!r} in {FP8_DTYPE} with its scale, or push it in BF16 without the scale")

    def missing(self) -> list[str]:
        """HF names still missing for the groups this sender must complete (the trainer's names: a
        scale only for an FP8 weight pushed pre-quantized)."""
        out = []
        for g in self._active:
            if g in self._done:
                continue
            have = self._staged.get(g, {})
            if not self._scale_of:
                out += [n for n in self._inputs[g] if n not in have]
                continue
            out += [n for n in self._required[g] if n not in have]
            out += [self._scale_of[n] for n in self._required[g]
                    if _is_fp8(have.get(n)) and self._scale_of[n] not in have]
        return out

    def check_complete(self) -> None:
        missing = self.missing()
        unscaled = [self._weight_of[n] for n in missing if n in self._weight_of]
        if unscaled:
            raise MissingTensors(
                f"HF tensor {unscaled[0]!r}{self._where} was pushed pre-quantized ({FP8_DTYPE}) but its scale "
                f"{self._scale_of[unscaled[0]]!r} never was" + (f" (and {len(unscaled) - 1} more)" if len(unscaled) > 1
                                                               else "")
                + ". Nothing was written for its parameter group; push the scale, or the weight in BF16.",
                parameter=self._scale_of[unscaled[0]])
        if missing:
            shown = ", ".join(missing[:10]) + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
            raise MissingTensors(
                f"update finished with {len(missing)} HF tensor(s) never pushed{self._where}: {shown}. "
                f"Nothing was written for their parameter groups; push them before finish().")


def _is_fp8(tensor: Any) -> bool:
    return tensor is not None and _dtype_name(tensor) == FP8_DTYPE
