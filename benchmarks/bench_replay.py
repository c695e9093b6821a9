"""Slot production: sglang's loaders vs replayed copy plans, bytes of filled slots per second.

    PYTHONPATH=python python3 benchmarks/bench_replay.py [--device cpu|cuda] [--layers N] [--steps 3] [--json]
                                                         [--out FILE]

One engine rank of each case (Qwen3-4B TP2 rank 0, Qwen3-30B-A3B TP8/EP8 rank 0, built-in shapes;
``--layers N`` keeps N decoder layers, 0 = all) packed into two slots of 512 MiB as the sender
does: groups in order, one producer call per slot. ``--device cpu``: HF tensors and host slots in
host memory; ``--device cuda``: HF tensors and slots on the GPU (GPU slots). Rows:

- loader: the replica's loaders (``P2PW_COPY_PLANS=off``), best of ``--steps`` fills;
- first: the first update with plans on (loaders + recording + the first replay's check), once;
- first (from disk): the same in a fresh replica of the same key whose plans were saved in its
  ``P2PW_REPLICA_CACHE_DIR`` (loaders + the check of each stored plan, no recording), once;
- replay: every group from its recorded plan, best of ``--steps`` fills (alternating with the
  loader fills, so both see the same memory state and neighbours); column ``copies``: the plan's
  ops, then (after "->") the wide byte copies they are replayed as;
- replay (other path): the replay the producer does not take on this device, as a baseline —
  element views in one multi-tensor copy (what GPU slots take) on a host, the wide byte copies
  (what host slots take) on a GPU.

Every replayed slot is compared byte for byte with the loaders' bytes of the same inputs
(column ``equal``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

CASES = (("qwen3-4b", "tp=2"), ("qwen3-30b-a3b", "tp=8,ep=8"))
COLUMNS = [
    ("model", "model", ""), ("engine", "engine", ""), ("device", "slots", ""), ("path", "path", ""),
    ("size", "bytes", ""), ("groups", "groups", "d"), ("copies", "copies", ""), ("seconds", "seconds", ".4f"),
    ("gbps", "GB/s", ".2f"), ("plan", "plan memory", ""), ("equal", "equal", ""),
]


class _Rank:
    def __init__(self, replica):
        self.replica = replica


def _config(model: str, layers: int, directory: str) -> str:
    from p2pweights.models import load_config, resolve_model

    cfg = load_config(resolve_model(model))
    if layers:
        cfg = {**cfg, "num_hidden_layers": layers}
    path = os.path.join(directory, f"{model}-{layers or 'all'}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def _slot_batches(replica, slot_bytes: int) -> list[list]:
    """(group, offset) lists, one per slot, as the pipeline packs them."""
    batches, placed, off = [], [], 0
    for g in replica.groups:
        if off + g.nbytes > slot_bytes:
            batches.append(placed)
            placed, off = [], 0
        placed.append((g, off))
        off = -(-(off + g.nbytes) // 256) * 256
    return batches + [placed]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _fill(producer, rank, batches, inputs, slots, device) -> float:
    t0 = time.perf_counter()
    for i, placed in enumerate(batches):
        producer(rank, placed, {n: inputs[n] for g, _ in placed for n in g.hf_names}, slots[i % 2])
    _sync(device)
    return time.perf_counter() - t0


def _other_replay(plans_of, replica, device):
    """The replay path the producer does NOT take on this device, as a baseline: element views in
    one multi-tensor copy (replica/element_ops.py; GPU slots take it) or wide byte copies
    (copy_plan.run_wide_ops; host slots take it)."""
    from p2pweights.replica.copy_plan import run_wide_ops
    from p2pweights.replica.element_ops import run_element_ops

    stored = plans_of(replica).plans
    wide = str(device).startswith("cuda")

    def produce(rank, placed, tensors, slot):
        for group, offset in placed:
            plan = stored[group.index]
            inputs = [tensors[n] for n in plan.inputs]
            if wide:
                run_wide_ops(plan.wide_ops, inputs, slot, slot.storage_offset() * slot.element_size() + offset)
            else:
                run_element_ops(plan.ops, plan.regions, plan.itemsizes, inputs, slot[offset:])
    return produce, ("wide copies" if wide else "element ops")


def run_case(model: str, spec: str, device: str, layers: int, steps: int, directory: str) -> list[dict]:
    import torch

    from p2pweights.models.checkpoint import random_tensor
    from p2pweights.replica import EngineLayout, ModelReplicas
    from p2pweights.sender.buffers import slot_size
    from p2pweights.sender.replay import SlotProducer, plan_memory, plans_of
    from p2pweights.sender.report import UpdateTimes
    from p2pweights.settings import format_size

    cache = os.path.join(directory, "replica-cache")
    config = _config(model, layers, directory)
    replica = ModelReplicas(cache_dir=cache).get(config, EngineLayout.parse(spec), 0)
    rank = _Rank(replica)
    needed = {n for g in replica.groups for n in g.hf_names}
    inputs = {n: random_tensor(n, s, 1).to(device) for n, s in replica.hf_specs.items() if n in needed}
    slot_bytes = slot_size(512 << 20, replica.largest_group_nbytes)
    slots = [torch.zeros(slot_bytes, dtype=torch.uint8, device=device) for _ in range(2)]
    batches = _slot_batches(replica, slot_bytes)
    total = sum(g.nbytes for g in replica.groups)
    base = {"model": model, "engine": spec, "device": device, "size": format_size(total), "bytes": total,
            "groups": len(replica.groups), "layers": layers or "all"}
    rows = []

    times = UpdateTimes()
    plans = SlotProducer(times)
    first = _fill(plans, rank, batches, inputs, slots, device)  # loaders + recording + the first check
    stored = plans_of(replica).plans.values()
    copies = f"{sum(len(p.ops) for p in stored)}->{sum(len(p.wide_ops) for p in stored)}"
    memory = format_size(plan_memory([replica]))
    # a fresh process's view: another replica of the same key, its plans read from the cache folder
    again = ModelReplicas(cache_dir=cache).get(config, EngineLayout.parse(spec), 0)
    _ = again.model  # the meta model is built on the first load; not part of the plans' cost
    disk_times = UpdateTimes()
    from_disk = _fill(SlotProducer(disk_times), _Rank(again), batches, inputs, slots, device)
    disk_plans = plans_of(again)
    loader = SlotProducer(UpdateTimes(), enabled=False)
    element, other = _other_replay(plans_of, replica, device)
    # alternate the paths (same memory state, same neighbours on a shared host): best of each
    best = {"loader": float("inf"), "replay": float("inf"), "element": float("inf")}
    for _ in range(steps):
        best["loader"] = min(best["loader"], _fill(loader, rank, batches, inputs, slots, device))
        best["replay"] = min(best["replay"], _fill(plans, rank, batches, inputs, slots, device))
        best["element"] = min(best["element"], _fill(element, rank, batches, inputs, slots, device))
    rows.append({**base, "path": "loader", "copies": "-", "seconds": best["loader"], "plan": "-", "equal": "-"})
    rows.append({**base, "path": f"first ({times.recorded} recorded)", "copies": copies, "seconds": first,
                 "plan": memory, "equal": "-"})
    rows.append({**base, "path": f"first from disk ({len(disk_plans.plans)} checked, {disk_times.recorded} recorded)",
                 "copies": copies, "seconds": from_disk, "plan": memory, "equal": "-"})
    rows.append({**base, "path": f"replay (other path: {other})", "copies": copies, "seconds": best["element"],
                 "plan": memory, "equal": "-"})
    sec = best["replay"]
    # the check: each slot replayed, then the loaders' bytes of the same inputs, region by region
    equal = True
    check = torch.zeros_like(slots[0])
    for placed in batches:
        tensors = {n: inputs[n] for g, _ in placed for n in g.hf_names}
        regions = plans(rank, placed, tensors, slots[0])
        replica.load_groups(placed, tensors, check)
        equal &= all(torch.equal(slots[0][r.offset:r.offset + r.nbytes], check[r.offset:r.offset + r.nbytes])
                     for r in regions)
    rows.append({**base, "path": f"replay ({times.replayed // (steps + 1)} groups)", "copies": copies,
                 "seconds": sec, "plan": memory, "equal": str(equal)})
    for r in rows:
        r["gbps"] = total / r["seconds"] / 1e9
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (host slots) or cuda[:N] (GPU slots, GPU HF tensors)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers kept (0 = all; default 4 on a small host)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--models", default=",".join(m for m, _ in CASES))
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="also write the rows as JSON to this file")
    a = p.parse_args()
    from p2pweights.bench.table import emit

    rows = []
    with tempfile.TemporaryDirectory() as d:
        for model, spec in CASES:
            if model in a.models.split(","):
                print(f"# {model} {spec} on {a.device} ...", file=sys.stderr, flush=True)
                rows += run_case(model, spec, a.device, a.layers, a.steps, d)
    ok = all(r["equal"] != "False" for r in rows)
    speedups = {}
    for model, spec in CASES:
        mine = {r["path"]: r for r in rows if r["model"] == model}
        paths = {p.split(" (")[0] if not p.startswith("replay (other") else "other": r for p, r in mine.items()}
        if "loader" in paths and "replay" in paths:
            speedups[f"{model} {spec}"] = {
                "replay/loader": paths["replay"]["gbps"] / paths["loader"]["gbps"],
                "replay/other path": paths["replay"]["gbps"] / paths["other"]["gbps"],
                "first from disk/first": paths["first from disk"]["seconds"] / paths["first"]["seconds"],
            }
    footer = "# " + "; ".join(f"{k}: " + ", ".join(f"{n} {v:.2f}x" for n, v in d.items()) for k, d in speedups.items())
    footer += "\n# " + ("OK" if ok else "FAILED") + ": every replayed slot byte-exact against the loaders"
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, "speedup": speedups, "ok": ok, "device": a.device, "layers": a.layers}, f, indent=2)
    emit(f"slot production, loaders vs replayed copy plans ({a.device}, layers={a.layers or 'all'})", COLUMNS, rows,
         as_json=a.json, footer=footer, extra={"speedup": speedups, "ok": ok} if a.json else None)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
