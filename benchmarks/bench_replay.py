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
- replay: every group from its recorded plan as the producer replays it (the default
  ``copyplans.ReplayOrder``: one native call per slot where it runs), best of ``--steps`` fills
  (alternating with the other rows' fills, so all see the same memory state and neighbours); column
  ``copies``: the plan's ops, then (after "->") the native program's 2-D copy descriptors;
- replay: <path>: each path of the replay order forced, as an A/B in the same run (an order of that
  path alone, then the element views): the element views in one multi-tensor copy per group
  (copyplans/element_views.py), and the native programs: on a host memcpy across
  ``P2PW_COPY_THREADS`` threads and across 1; on a GPU the batched copy kernel and the driver copies
  on 1, 4, ``P2PW_COPY_LANES`` and 16 streams. A native row that fell back to the element views says
  so (FELL BACK, with the reason).

Every replay path's slot is compared byte for byte with the loaders' bytes of the same inputs
(column ``equal``); the footer gives native/element ratios. ``--json`` / ``--out``:
the same rows as JSON.
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


def _paths(plans_of, replica, device: str, threads: int) -> dict[str, tuple]:
    """Every replay path of this device as a producer, for the A/B rows (name -> (producer, order)):
    an order of that path alone (then the element views, where a path that cannot run falls back)."""
    from p2pweights import settings
    from p2pweights.copyplans import ReplayOrder, ReplayPath

    stored = plans_of(replica).plans
    views = ReplayPath.ELEMENT_VIEWS

    def produce_with(order):
        def produce(rank, placed, tensors, slot):
            order.replay_slot([(stored[g.index], off) for g, off in placed], tensors, slot)
        return produce, order

    paths = {"element views": produce_with(ReplayOrder(host=(views,), gpu=(views,)))}
    if device.startswith("cuda"):
        paths["native kernel"] = produce_with(ReplayOrder(gpu=(ReplayPath.KERNEL, views)))
        for lanes in sorted({1, 4, settings.value("P2PW_COPY_LANES"), 16}):  # streams the copies are spread over
            paths[f"native driver copies, {lanes} lane(s)"] = produce_with(
                ReplayOrder(gpu=(ReplayPath.DRIVER_COPIES, views), lanes=lanes))
    else:
        for n in sorted({threads, 1}, reverse=True):
            paths[f"native {n} thread(s)"] = produce_with(ReplayOrder(host=(ReplayPath.NATIVE_HOST, views), threads=n))
    return paths


def run_case(model: str, spec: str, device: str, layers: int, steps: int, directory: str) -> list[dict]:
    import torch

    from p2pweights import _native, settings
    from p2pweights.copyplans import ReplayOrder, ReplayPath, plan_memory, plans_of, program_of
    from p2pweights.models.checkpoint import random_tensor
    from p2pweights.models.engine_layout import EngineLayout
    from p2pweights.replica import ModelReplicas
    from p2pweights.sender.buffers import slot_size
    from p2pweights.sender.report import UpdateTimes
    from p2pweights.sender.slot_producer import SlotProducer
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
    plans = SlotProducer(times, ReplayOrder())
    first = _fill(plans, rank, batches, inputs, slots, device)  # loaders + recording + the first check
    stored = plans_of(replica).plans.values()
    descriptors = sum(len(program_of(p)) for p in stored)
    copies = f"{sum(len(p.ops) for p in stored)}->{descriptors}"
    memory = format_size(plan_memory([replica]))
    # a fresh process's view: another replica of the same key, its plans read from the cache folder
    again = ModelReplicas(cache_dir=cache).get(config, EngineLayout.parse(spec), 0)
    _ = again.model  # the meta model is built on the first load; not part of the plans' cost
    disk_times = UpdateTimes()
    from_disk = _fill(SlotProducer(disk_times, ReplayOrder()), _Rank(again), batches, inputs, slots, device)
    disk_plans = plans_of(again)
    loader = SlotProducer(UpdateTimes(), ReplayOrder(), enabled=False)
    paths = _paths(plans_of, replica, device, settings.value("P2PW_COPY_THREADS"))
    # alternate the paths (same memory state, same neighbours on a shared host): best of each
    best = {name: float("inf") for name in ["loader", "replay", *paths]}
    for _ in range(steps):
        best["loader"] = min(best["loader"], _fill(loader, rank, batches, inputs, slots, device))
        best["replay"] = min(best["replay"], _fill(plans, rank, batches, inputs, slots, device))
        for name, (produce, _) in paths.items():
            best[name] = min(best[name], _fill(produce, rank, batches, inputs, slots, device))
    # the check: each slot filled by every path, then the loaders' bytes of the same inputs, region by region
    equal = {name: True for name in ["replay", *paths]}
    check = torch.zeros_like(slots[0])
    for placed in batches:
        tensors = {n: inputs[n] for g, _ in placed for n in g.hf_names}
        replica.load_groups(placed, tensors, check)
        for name, produce in [("replay", plans), *((n, p) for n, (p, _) in paths.items())]:
            slots[0].fill_(0xA5)
            produce(rank, placed, tensors, slots[0])
            regions = [r for g, off in placed for r in _regions(g, off)]
            _sync(device)
            equal[name] &= all(torch.equal(slots[0][r.offset:r.offset + r.nbytes], check[r.offset:r.offset + r.nbytes])
                               for r in regions)
    rows.append({**base, "key": "loader", "path": "loader", "copies": "-", "seconds": best["loader"], "plan": "-", "equal": "-"})
    rows.append({**base, "key": "first", "path": f"first ({times.recorded} recorded)", "copies": copies, "seconds": first,
                 "plan": memory, "equal": "-"})
    disk = f"first from disk ({len(disk_plans.plans)} checked, {disk_times.recorded} recorded)"
    rows.append({**base, "key": "first from disk", "path": disk,
                 "copies": copies, "seconds": from_disk, "plan": memory, "equal": "-"})
    for name, (_, order) in paths.items():
        note = ""
        fell_back = order.groups.get(ReplayPath.ELEMENT_VIEWS, 0) if name.startswith("native") else 0
        if fell_back:
            why = "; ".join(order.off.values()) or "inputs the native copies cannot take"
            note = f" FELL BACK {fell_back} groups: {why}"
        elif "kernel" in name and not _native.cuda_driver_info()["kernel"]:
            note = " FELL BACK: the module was built without nvcc"
        elif name.startswith("native") and device.startswith("cuda"):
            note = f" ({order.driver_calls // (steps + 1)} driver calls per fill)"  # steps + the check's fill
        rows.append({**base, "key": name, "path": f"replay: {name}{note}", "copies": copies, "seconds": best[name],
                     "plan": memory, "equal": str(equal[name])})
    rows.append({**base, "key": "replay", "path": f"replay ({times.replayed // (steps + 1)} groups)", "copies": copies,
                 "seconds": best["replay"], "plan": memory, "equal": str(equal["replay"])})
    # the ceiling on this device: the same bytes per slot as ONE contiguous copy (no plan; not checked)
    flat = torch.empty(max(sum(g.nbytes for g, _ in placed) for placed in batches), dtype=torch.uint8, device=device)
    ceiling = float("inf")
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        for i, placed in enumerate(batches):
            n = sum(g.nbytes for g, _ in placed)
            slots[i % 2][:n].copy_(flat[:n])
        _sync(device)
        ceiling = min(ceiling, time.perf_counter() - t0)
    rows.append({**base, "key": "ceiling", "path": "ceiling: one contiguous copy per slot (torch copy_)",
                 "copies": f"{len(batches)}", "seconds": ceiling, "plan": "-", "equal": "-"})
    for r in rows:
        r["gbps"] = total / r["seconds"] / 1e9
    return rows


def _regions(group, offset):
    from p2pweights.replica.groups import SlotRegion

    return [SlotRegion(r.param_name, offset + r.offset, r.nbytes) for r in group.regions]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu (host slots) or cuda[:N] (GPU slots, GPU HF tensors)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers kept (0 = all; default 4 on a small host)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--models", default=",".join(m for m, _ in CASES))
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", help="also write the rows as JSON to this file")
    a = p.parse_args()
    from p2pweights.benchmarking.table import emit

    rows = []
    with tempfile.TemporaryDirectory() as d:
        for model, spec in CASES:
            if model in a.models.split(","):
                print(f"# {model} {spec} on {a.device} ...", file=sys.stderr, flush=True)
                rows += run_case(model, spec, a.device, a.layers, a.steps, d)
    ok = all(r["equal"] != "False" for r in rows)
    speedups = {}
    for model, spec in CASES:
        paths = {r["key"]: r for r in rows if r["model"] == model}
        if "loader" in paths and "replay" in paths:
            ratio = {"replay/loader": paths["replay"]["gbps"] / paths["loader"]["gbps"]}
            for name in (k for k in paths if k.startswith("native")):
                ratio[f"{name}/element"] = paths[name]["gbps"] / paths["element views"]["gbps"]
            ratio["first from disk/first"] = paths["first from disk"]["seconds"] / paths["first"]["seconds"]
            speedups[f"{model} {spec}"] = ratio
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
