"""Recorded copy plans: what a parameter group's loaders do to each byte of its slot, as strided copies.

sglang's loaders produce a group's bytes with hundreds of small Python-driven copies (narrow,
chunk, cat, copy_). For almost every parameter the result is a pure selection of input elements,
so it can be recorded once per (replica, group) and replayed as a few large copies.

Recording (:func:`record_group_plan`) runs the group's own loaders (``load_group``) on
inputs whose bytes encode their own element index: element j of input i carries the id
``base_i + j`` (ids start at 1; 0 is "zero", the bytes the slot has before the loaders ran).
Each element of size s bytes holds 8·s bits of its id per pass; a group whose ids need more bits
runs the loaders again with the next bits (bf16 inputs of fewer than 65,536 elements: one pass;
up to 4 G elements: two). The loaders only move bytes, so every destination element then holds
the id of the input element it came from: a pure copy, whatever the dtype (bf16, fp8, float32 —
bytes are bytes; the ids are reinterpreted as same-size integers). A destination element holding
0 was zero-filled (padding rows, or left untouched by a partial loader, which the loader path
zeroes too). Anything else — a dtype change, arithmetic, a constant other than 0 — decodes to ids
that are out of range, point at an element of another size, or disagree with the real bytes:
the group is refused and stays on the loader path.

Compression: per parameter, runs of consecutive ids become contiguous copies; runs of equal
length with constant strides in source and destination merge into strided blocks (a column
shard of a row-parallel weight is one 2-D copy); blocks merge again into up to 4-D copies.

A recorded plan is compiled and checked by the native core before it is returned (program.py): a
plan the check refuses, or one too fragmented to compile, is :class:`NotACopy` like a computing
loader, and its group stays on the loader path.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ..replica.groups import ParameterGroup, SlotRegion
from .element_views import int_dtype as _int_dtype
from .group_plan import MAX_DIMS, GroupPlan, NotACopy, Op
from .program import PlanRefused, program_of

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ..replica.model_replica import ModelReplica
    from .replay import ReplayOrder

_CHUNK = 1 << 24  # elements encoded or decoded at a time (bounds the int64 temporaries)
_WIDTHS = (8, 4, 2, 1)


# -- recording ------------------------------------------------------------------------------------
def _nothing() -> None:
    pass


def _passes_needed(total_ids: int, itemsize: int) -> int:
    bits = max(total_ids.bit_length(), 1)
    return -(-bits // (8 * itemsize))


def _id_dtype(total_ids: int) -> "torch.dtype":
    """int32 ids while they fit (half the memory traffic of int64), else int64."""
    import torch

    return torch.int32 if total_ids < (1 << 31) else torch.int64


def _encode(out: "torch.Tensor", base: int, pass_: int, total_ids: int) -> None:
    """Fill ``out`` so that its element j holds bytes [pass·s, (pass+1)·s) of the little-endian
    id base + j (s: the element size): plain element moves of s-byte integers, no arithmetic."""
    import torch

    size = out.element_size()
    id_dtype = _id_dtype(total_ids)
    width = id_dtype.itemsize
    flat = out.view(-1).view(_int_dtype(size))
    if pass_ * size >= width:
        flat.zero_()
        return
    if size <= 2:  # 1- and 2-byte digits repeat or stay constant in long stretches: no id arithmetic
        _fill_digits(flat, base, pass_, size)
        return
    for start in range(0, flat.numel(), _CHUNK):
        n = min(_CHUNK, flat.numel() - start)
        ids = torch.arange(base + start, base + start + n, dtype=id_dtype, device=out.device)
        if size <= width:  # the pass-th s-byte part of each id
            flat[start:start + n] = ids.view(_int_dtype(size)).view(n, width // size)[:, pass_]
        else:  # an 8-byte element holds a whole 4-byte id, zero above
            wide = flat[start:start + n].view(id_dtype).view(n, size // width)
            wide[:, 0] = ids
            wide[:, 1:] = 0


def _fill_digits(flat: "torch.Tensor", base: int, pass_: int, size: int) -> None:
    """``flat[j]`` = digit ``pass_`` (base 2^(8·size)) of ``base + j``, written as broadcast copies:
    digit 0 repeats with period B (copied from one period, B = 256 or 65,536 elements); digit p > 0
    is constant over aligned blocks of B^p ids (one small vector of block values, expanded). The
    same bytes as the id arithmetic, at memory speed (``torch.arange`` over every element took
    most of a recording)."""
    import torch

    n = flat.numel()
    period = 1 << (8 * size)
    kind = _int_dtype(size)
    if pass_ == 0:  # x mod B: whole periods copied from one
        pattern = torch.arange(period, dtype=torch.int64, device=flat.device).to(kind)  # wraps to the low bytes
        start = base % period
        head = min(n, period - start)
        flat[:head].copy_(pattern[start:start + head])
        full, tail = divmod(n - head, period)
        if full:
            flat[head:head + full * period].view(full, period).copy_(pattern.expand(full, period))
        if tail:
            flat[n - tail:].copy_(pattern[:tail])
        return
    block = period ** pass_
    first_block = base // block
    head = min(n, (first_block + 1) * block - base)  # ids up to the first block boundary
    full, tail = divmod(n - head, block)
    values = (torch.arange(first_block, first_block + 2 + full, dtype=torch.int64, device=flat.device)
              % period).to(kind)
    flat[:head].copy_(values[0].expand(head))
    if full:
        flat[head:head + full * block].view(full, block).copy_(values[1:1 + full, None].expand(full, block))
    if tail:
        flat[n - tail:].copy_(values[1 + full].expand(tail))


def _decode(passes: Sequence["torch.Tensor"], region: SlotRegion, itemsize: int, start: int, n: int,
            total_ids: int) -> "torch.Tensor":
    """The ids held by elements [start, start + n) of ``region`` across the recorded passes (on
    their device: a GPU finds the runs itself and hands the host only their starts): each pass's
    elements are the next s-byte parts of the little-endian id."""
    import torch

    id_dtype = _id_dtype(total_ids)
    width = id_dtype.itemsize
    passes_count = _passes_needed(total_ids, itemsize)
    device = passes[0].device
    covered = itemsize > width or passes_count * itemsize == width  # every id byte is written below
    ids = torch.empty(n, dtype=id_dtype, device=device) if covered else torch.zeros(n, dtype=id_dtype, device=device)
    for p in range(passes_count):
        raw = passes[p][region.offset + start * itemsize:region.offset + (start + n) * itemsize]
        if itemsize <= width:
            ids.view(_int_dtype(itemsize)).view(n, width // itemsize)[:, p] = raw.view(_int_dtype(itemsize))
        else:
            wide = raw.view(id_dtype).view(n, itemsize // width)
            if bool((wide[:, 1:] != 0).any()):  # more than an id: a converted or computed value
                ids.fill_(-1)
                return ids
            ids.copy_(wide[:, 0])
    return ids


def _runs(ids: "torch.Tensor", starts: "np.ndarray", itemsizes: "np.ndarray", itemsize: int, total_ids: int,
          param: str) -> tuple["np.ndarray", ...]:
    """Contiguous runs of one region's ids: (dst start, input or -1, src start, length). Element
    work is a few vectorized passes; only run starts are looked at one by one."""
    import numpy as np
    import torch

    n = ids.numel()
    if n == 0:
        return tuple(np.zeros(0, dtype=np.int64) for _ in range(4))
    low, high = (int(x) for x in torch.aminmax(ids))
    if low < 0 or high >= total_ids:
        raise NotACopy(param, "holds bytes that are no input element (computed, converted or a constant fill)")
    step = ids[1:] - ids[:-1]
    breaks = (step != 1) & ((step != 0) | (ids[1:] != 0))  # a run of zero fills continues through zeros
    starts_t = torch.nonzero(breaks).view(-1) + 1
    first_ids = torch.cat([ids[:1], ids[starts_t]]).cpu().numpy().astype(np.int64)
    first = np.concatenate([np.zeros(1, dtype=np.int64), starts_t.cpu().numpy()])
    lengths = np.diff(np.append(first, n))
    # a run of consecutive ids may cross from one input into the next: split it there
    inp = np.searchsorted(starts, first_ids, side="right") - 1
    last = np.searchsorted(starts, first_ids + lengths - 1, side="right") - 1
    zero = first_ids == 0
    crossing = np.flatnonzero((inp != last) & ~zero)
    if len(crossing):
        cut_at, cut_ids = [], []
        for k in crossing.tolist():
            for j in range(inp[k] + 1, last[k] + 1):
                cut_at.append(first[k] + int(starts[j] - first_ids[k]))
                cut_ids.append(int(starts[j]))
        first = np.concatenate([first, np.array(cut_at, dtype=np.int64)])
        first_ids = np.concatenate([first_ids, np.array(cut_ids, dtype=np.int64)])
        order = np.argsort(first, kind="stable")
        first, first_ids = first[order], first_ids[order]
        lengths = np.diff(np.append(first, n))
        inp = np.searchsorted(starts, first_ids, side="right") - 1
        zero = first_ids == 0
    inp = np.where(zero, -1, inp)
    if (itemsizes[inp[~zero]] != itemsize).any():
        raise NotACopy(param, "holds elements of another size than its inputs' (a dtype change)")
    src = np.where(zero, 0, first_ids - starts[np.maximum(inp, 0)])
    return first, inp, src, lengths


def _merge(ops: dict[str, "np.ndarray"]) -> dict[str, "np.ndarray"]:
    """Merge consecutive ops of equal shape, input and strides whose offsets advance by constant
    steps into ops of one more dimension (greedy, left to right)."""
    import numpy as np

    n = len(ops["inp"])
    if n < 2:
        return ops
    key = np.concatenate([ops["inp"][:, None], ops["ndim"][:, None], ops["sizes"], ops["dstr"], ops["sstr"]], axis=1)
    same = np.zeros(n, dtype=bool)
    same[1:] = (key[1:] == key[:-1]).all(axis=1) & (ops["ndim"][1:] < MAX_DIMS)
    dd = np.zeros(n, dtype=np.int64)
    sd = np.zeros(n, dtype=np.int64)
    dd[1:] = ops["dst"][1:] - ops["dst"][:-1]
    sd[1:] = ops["src"][1:] - ops["src"][:-1]
    # pair j joins op j-1 and op j; maximal stretches of pairs with one signature
    sig_change = np.ones(n, dtype=bool)
    sig_change[2:] = ~(same[2:] & same[1:-1] & (dd[2:] == dd[1:-1]) & (sd[2:] == sd[1:-1]))
    blocks: list[tuple[int, int]] = []  # [first op, last op] of each merged block
    free = 0
    pair_starts = np.flatnonzero(sig_change[1:]) + 1
    pair_ends = np.append(pair_starts[1:] - 1, n - 1)
    for a, b in zip(pair_starts.tolist(), pair_ends.tolist()):
        if not same[a]:
            continue
        first = max(a - 1, free)
        if b - first >= 1:
            blocks.append((first, b))
            free = b + 1
    if not blocks:
        return ops
    keep = np.ones(n, dtype=bool)
    out = {k: v.copy() for k, v in ops.items()}
    for first, last in blocks:
        keep[first + 1:last + 1] = False
        count = last - first + 1
        nd = int(ops["ndim"][first])
        # dims are right-aligned: the new outer dimension goes left of the current ones
        col = MAX_DIMS - nd - 1
        out["sizes"][first, col] = count
        out["dstr"][first, col] = dd[first + 1]
        out["sstr"][first, col] = sd[first + 1]
        out["ndim"][first] = nd + 1
    return {k: v[keep] for k, v in out.items()}


def _region_ops(region_index: int, ids_runs: tuple["np.ndarray", ...]) -> list[Op]:
    import numpy as np

    first, inp, src, lengths = ids_runs
    n = len(first)
    ops = {
        "inp": inp.astype(np.int64), "dst": first.astype(np.int64), "src": src.astype(np.int64),
        "ndim": np.ones(n, dtype=np.int64),
        "sizes": np.ones((n, MAX_DIMS), dtype=np.int64), "dstr": np.zeros((n, MAX_DIMS), dtype=np.int64),
        "sstr": np.zeros((n, MAX_DIMS), dtype=np.int64),
    }
    ops["sizes"][:, -1] = lengths
    ops["dstr"][:, -1] = 1
    ops["sstr"][:, -1] = np.where(inp < 0, 0, 1)
    for _ in range(MAX_DIMS - 1):
        before = len(ops["inp"])
        ops = _merge(ops)
        if len(ops["inp"]) == before:
            break
    out: list[Op] = []
    for i in range(len(ops["inp"])):
        nd = int(ops["ndim"][i])
        out.append((int(ops["inp"][i]), region_index, int(ops["dst"][i]), int(ops["src"][i]),
                    tuple(int(x) for x in ops["sizes"][i, MAX_DIMS - nd:]),
                    tuple(int(x) for x in ops["dstr"][i, MAX_DIMS - nd:]),
                    tuple(int(x) for x in ops["sstr"][i, MAX_DIMS - nd:])))
    return out


def record_group_plan(replica: "ModelReplica", group: ParameterGroup, like: Mapping[str, "torch.Tensor"],
                      device: Any = None, loaders_lock: Any = None,
                      between_steps: Callable[[], None] | None = None) -> GroupPlan:
    """Record the plan of ``group`` by running its loaders on id-encoded inputs shaped like ``like``.

    Runs on ``device`` (default: the first input's). Raises :class:`NotACopy` naming a parameter
    whose bytes are not a pure copy of input bytes.

    ``loaders_lock`` (a context manager, the replica's ``ReplicaPlans.loaders``) is held around each
    run of the loaders only: the encoding and decoding (most of a recording) touch nothing of the
    replica, so an update waits for one loader run at most. A caller that holds the lock already
    (the update path) passes none. ``between_steps`` is called before each step (a pass's encoding,
    a loader run, a region chunk's decoding): the background recorder waits there while an update
    is in flight, or raises to give the group up.
    """
    import numpy as np
    import torch

    # a replica that post-processes a group's bytes on send (vLLM's replayed kernels) says so
    why = getattr(replica, "not_a_copy", None)
    reason = why(group) if why is not None else None
    if reason:
        raise NotACopy(group.params[0], reason)
    between = between_steps if between_steps is not None else _nothing
    loaders = loaders_lock if loaders_lock is not None else contextlib.nullcontext()

    names = tuple(group.hf_names)
    device = device if device is not None else like[names[0]].device
    templates = {n: torch.empty(like[n].shape, dtype=like[n].dtype, device=device) for n in names}
    starts, sizes, itemsizes, base = [], [], [], 1
    for n in names:
        starts.append(base)
        sizes.append(templates[n].numel())
        itemsizes.append(templates[n].element_size())
        base += templates[n].numel()
    total_ids = base
    specs = replica.param_specs
    region_sizes = [getattr(torch, specs[r.param_name].dtype).itemsize for r in group.regions]
    passes_count = max(_passes_needed(total_ids, s) for s in itemsizes + region_sizes)
    passes = []
    for p in range(passes_count):
        between()
        for i, n in enumerate(names):
            _encode(templates[n], starts[i], p, total_ids)
        scratch = torch.zeros(group.nbytes, dtype=torch.uint8, device=device)
        between()
        with loaders:
            replica.load_group(group, templates, scratch, 0)
        passes.append(scratch)
    del templates
    starts_a, items_a = np.array(starts), np.array(itemsizes)
    ops: list[Op] = []
    for index, (region, itemsize) in enumerate(zip(group.regions, region_sizes)):
        numel = region.nbytes // itemsize
        for start in range(0, numel, _CHUNK):
            between()
            n = min(_CHUNK, numel - start)
            ids = _decode(passes, region, itemsize, start, n, total_ids)
            first, inp, src, lengths = _runs(ids, starts_a, items_a, itemsize, total_ids, region.param_name)
            ops += _region_ops(index, (first + start, inp, src, lengths))
    plan = GroupPlan(group.index, names, tuple((tuple(like[n].shape), str(like[n].dtype)) for n in names),
                     tuple(group.regions), tuple(region_sizes), _merge_chunk_seams(ops))
    try:
        program_of(plan)  # compiled and checked by the native core once, here
    except PlanRefused as e:
        raise NotACopy(plan.first_parameter, str(e)) from None
    return plan


def _merge_chunk_seams(ops: list[Op]) -> list[Op]:
    """Join a 1-D run split by a decode chunk boundary with the run right after it."""
    out: list[Op] = []
    for op in ops:
        if out:
            p = out[-1]
            if (len(p[4]) == 1 and len(op[4]) == 1 and p[0] == op[0] and p[1] == op[1]
                    and p[2] + p[4][0] == op[2] and (op[0] < 0 or p[3] + p[4][0] == op[3])):
                out[-1] = (p[0], p[1], p[2], p[3], (p[4][0] + op[4][0],), p[5], p[6])
                continue
        out.append(op)
    return out


def differing_parameters(plan: GroupPlan, expected: "torch.Tensor", expected_offset: int,
                         tensors: Mapping[str, "torch.Tensor"], order: "ReplayOrder") -> list[str]:
    """Replay ``plan`` (by ``order``) into scratch memory and name the parameters whose bytes differ
    from ``expected`` (the loaders' output, at ``expected_offset``): the first replay's check."""
    import torch

    scratch = torch.empty(plan.regions[-1].offset + plan.regions[-1].nbytes, dtype=torch.uint8,
                          device=expected.device)
    order.replay(plan, tensors, scratch, 0)
    if scratch.device.type == "cuda":
        torch.cuda.current_stream(scratch.device).synchronize()
    return [r.param_name for r in plan.regions
            if not _same_bytes(scratch[r.offset:r.offset + r.nbytes],
                               expected[expected_offset + r.offset:expected_offset + r.offset + r.nbytes])]


def _same_bytes(a: "torch.Tensor", b: "torch.Tensor") -> bool:
    """``torch.equal`` of two byte ranges, as the widest integers both allow (5x faster than bytes)."""
    import torch

    for w in _WIDTHS:
        if a.numel() % w == 0 and (a.storage_offset() % w, b.storage_offset() % w) == (0, 0):
            return torch.equal(a.view(_int_dtype(w)), b.view(_int_dtype(w)))
    return False  # unreachable: width 1 always fits
