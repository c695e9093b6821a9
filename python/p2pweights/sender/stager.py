"""The group stager: holds pushed HF tensors until every HF input of a parameter group arrived.

A parameter group is a connected component of HF names and parameters (q/k/v -> qkv_proj,
gate/up -> gate_up_proj, every expert of a layer -> w13/w2). Loading a group before all of its
inputs are here would write half-loaded bytes, so nothing is released for an incomplete group.
Sender memory stays bounded by the inputs of groups still incomplete (invariant 6).
"""
from __future__ import annotations

import difflib
from typing import Any, Iterable, Mapping, Sequence

from ..errors import LayoutMismatch, MissingTensors, P2PWeightsError, UnknownParameter


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
        unknown = sorted(set(expected or ()) - set(specs))
        if unknown:
            raise UnknownParameter(self._unknown_message(unknown[0], len(unknown)))
        # Checkpoint names no group reads (another EP rank's experts, layers this engine rank does
        # not hold) are accepted and dropped: the trainer pushes the whole checkpoint.
        exp = set(self._group_of) if expected is None else set(expected) & set(self._group_of)
        self._active = sorted({self._group_of[n] for n in exp})
        for g in self._active:
            outside = [n for n in self._inputs[g] if n not in exp]
            if outside:
                raise P2PWeightsError(
                    f"parameter group of {self._inputs[g][0]!r}{self._where} needs {outside[0]!r}, which this "
                    f"sender does not push (expected names split a group across senders or PP stages)")
        self.reset()

    def reset(self) -> None:
        self._staged: dict[int, dict[str, Any]] = {}
        self._done: set[int] = set()

    @property
    def num_groups(self) -> int:
        return len(self._active)

    @property
    def staged_bytes(self) -> int:
        return sum(int(t.numel()) * t.element_size() for g in self._staged.values() for t in g.values())

    def group_inputs(self, group: int) -> list[str]:
        return list(self._inputs[group])

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
        if tuple(tensor.shape) != tuple(spec.shape) or _dtype_name(tensor) != spec.dtype:
            raise LayoutMismatch(
                f"HF tensor {name!r}{self._where}: got shape {tuple(tensor.shape)} dtype {_dtype_name(tensor)}, "
                f"the engine's model expects shape {tuple(spec.shape)} dtype {spec.dtype} (push the full, "
                f"gathered tensor in the checkpoint's dtype)")
        g = self._group_of.get(name)
        if g is None:
            return None  # this engine rank loads nothing from it
        if g in self._done or name in self._staged.get(g, {}):
            raise P2PWeightsError(f"HF tensor {name!r}{self._where} was pushed twice in one update")
        if g not in self._active:
            raise P2PWeightsError(f"HF tensor {name!r}{self._where} belongs to another sender's (PP stage's) parameters")
        staged = self._staged.setdefault(g, {})
        staged[name] = tensor
        if len(staged) < len(self._inputs[g]):
            return None
        del self._staged[g]
        self._done.add(g)
        return g, staged

    def missing(self) -> list[str]:
        """HF names still missing for the groups this sender must complete."""
        out = []
        for g in self._active:
            if g in self._done:
                continue
            have = self._staged.get(g, {})
            out += [n for n in self._inputs[g] if n not in have]
        return out

    def check_complete(self) -> None:
        missing = self.missing()
        if missing:
            shown = ", ".join(missing[:10]) + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else "")
            raise MissingTensors(
                f"update finished with {len(missing)} HF tensor(s) never pushed{self._where}: {shown}. "
                f"Nothing was written for their parameter groups; push them before finish().")
