"""The bulk push: ``Update.push_many`` and ``Update.push_fused`` without the per-tensor checks' Python.

A trainer pushes the whole checkpoint of its stage every update: 400 tensors for a dense 4B model,
tens of thousands for an HF-layout MoE (every expert its own tensor). ``push`` checks each tensor on
its own (tied name, DTensor, density, cast, shape, dtype, FP8 pair; inputs.py, stager.py): ~5 us of
Python each. ``push_many`` checks the common case against one table built once per connect
(:class:`PushTable`: name -> expected ``torch.Size`` and ``torch.dtype`` of every name the prepared
ranks' stagers agree on and that is no FP8 pair member) with a handful of attribute reads, stages
the tensors that pass without repeating the checks (``GroupStager.stage_checked``), and places each
group as it completes, as ``push`` does. A tensor the table does not admit — a name it lacks (tied,
unknown, an FP8 weight to quantize or its scale), another type (a DTensor), shape, dtype or layout,
a meta or nested tensor — goes through ``push`` itself, in order, so it gets exactly ``push``'s
result: converted, or refused naming it. ``check_finite`` needs every tensor's values: with it on,
every tensor goes through ``push``.

``push_fused(names, tensor)``: a trainer holding an MoE layer's experts fused (Megatron's grouped
GEMM weights stacked on dim 0) pushes them as one tensor; one ``unbind`` makes the per-expert views
(no copy, no per-expert slicing in Python) and the copy plans read each view where it lies.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

from ..errors import LayoutMismatch
from .transforms import GroupLoad, apply_transforms

if TYPE_CHECKING:
    from .prepared import PreparedRank

# ``update`` below is an update.Update (typed Any: update.py imports this module)
#: tensors staged between two placements: groups are placed as they complete, in chunks of this
#: many pushes, so the first slot reaches the writer early while staging stays one tight loop
CHUNK = 256


class PushTable:
    """What the bulk push checks, per HF name, for the prepared ranks of one connect."""

    def __init__(self, ranks: Sequence["PreparedRank"]):
        import torch

        self.key = tuple(id(p.stager) for p in ranks)
        self.types = (torch.Tensor, torch.nn.Parameter)  # a DTensor or another subclass: push()
        self.strided = torch.strided
        seen: dict[str, Any] = {}
        refused: set[str] = set()
        count: dict[str, int] = {}
        for p in ranks:
            paired = p.stager.paired_names
            for name, spec in p.stager.specs.items():
                dtype = getattr(torch, str(spec.dtype), None)
                entry = (torch.Size(tuple(spec.shape)), dtype)
                if name in paired or not isinstance(dtype, torch.dtype) or seen.get(name, entry) != entry:
                    refused.add(name)
                seen[name] = entry
                count[name] = count.get(name, 0) + 1
        # a name some rank's stager lacks is refused there by push() (UnknownParameter): not bulk
        self.plain: dict[str, tuple[Any, Any]] = {n: e for n, e in seen.items()
                                                  if n not in refused and count[n] == len(ranks)}


def table_of(ranks: Sequence["PreparedRank"]) -> PushTable:
    """The ranks' table, built at the first bulk push after a connect and kept by rank 0's stager."""
    holder = ranks[0].stager
    table = holder.bulk_table
    if table is None or table.key != tuple(id(p.stager) for p in ranks):
        table = holder.bulk_table = PushTable(ranks)
    return table


def push_many(update: Any, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
    """Every (name, tensor) of ``named_tensors`` (a dict or pairs), as ``push`` would, in order."""
    update._require_active()
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    ranks = update._ranks
    inputs = update._inputs
    if not ranks or (inputs is not None and inputs.check_finite):
        for name, tensor in items:
            update.push(name, tensor)
        return
    table = table_of(ranks)
    plain, types, strided = table.plain, table.types, table.strided
    chunk: list[tuple[str, Any]] = []
    for name, t in items:
        entry = plain.get(name)
        if (entry is None or type(t) not in types or t.dtype is not entry[1] or t.shape != entry[0]
                or t.layout is not strided or t.is_meta or t.is_nested):
            _stage(update, chunk)
            chunk = []
            update.push(name, t)  # push's own checks: converted, or refused naming it
            continue
        chunk.append((name, t))
        if len(chunk) >= CHUNK:
            _stage(update, chunk)
            chunk = []
    _stage(update, chunk)


def push_fused(update: Any, names: Sequence[str], tensor: Any) -> None:
    """``tensor[i]`` is HF tensor ``names[i]`` (experts stacked on dim 0): pushed as views."""
    if getattr(tensor, "dim", lambda: 0)() < 1 or tensor.shape[0] != len(names):
        raise LayoutMismatch(
            f"push_fused: {len(names)} name(s) ({names[0] if names else '-'!r}, ...) for a tensor of shape "
            f"{tuple(getattr(tensor, 'shape', ()))}: dim 0 must hold one entry per name", parameter=names[0] if names else None,
            hint="stack the experts on dim 0, in the order of names")
    push_many(update, zip(names, tensor.unbind(0)))


def _stage(update: Any, chunk: list[tuple[str, Any]]) -> None:
    """Stage checked tensors on every prepared rank; transform and place the groups they complete."""
    if not chunk:
        return
    t0 = time.perf_counter()
    loads: list[GroupLoad] = []
    transforms = update._transforms
    stagers = [(p, p.stager.stage_checked) for p in update._ranks]
    try:
        for name, t in chunk:  # as push(): each tensor on every rank before the next (a refusal stops both)
            for p, stage in stagers:
                done = stage(name, t)
                if done is not None:
                    loads += apply_transforms(transforms, GroupLoad(p, p.replica.groups[done[0]], done[1]))
    except BaseException:
        # a tensor refused (pushed twice, another sender's): the groups completed before it are
        # placed, as push() would have placed them; the stager counts them done, so none may be lost
        if loads:
            update._place(loads, t0)
        raise
    update._place(loads, t0)
