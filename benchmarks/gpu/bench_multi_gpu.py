"""P2P writes vs the NCCL broadcast baseline across the GPUs of one host, in one call.

    source scripts/gpu_env.sh   # P2PW_SGLANG_IMPORT_AS_CPU=1 P2PW_RECEIVER_LAUNCH=spawn
    python benchmarks/gpu/bench_multi_gpu.py [--cases qwen3-4b:tp=2,qwen3-30b-a3b:tp=2,ep=2 ...] [--steps 3]

The trainer's sender sits on GPU 0 with the full HF tensors in its memory (random weights); one
engine of T ranks sits on GPUs 1..T with its parameters in VRAM (receiver processes holding
sglang's model of their rank). Per case: K P2P updates (NIXL over UCX cuda_ipc, GPU slots) and K
broadcast updates (sglang's update_weights_from_distributed over NCCL, one sender); the last step
of each mode is checked byte for byte against sglang's own loader. Seconds run from
pause_generation returning to the update returning. NVLink multicast stays off. Needs 1 + T GPUs;
cases that do not fit are skipped with the reason. Prints a table and writes JSON to $OUT.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

for k, v in {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
             "P2PW_SGLANG_IMPORT_AS_CPU": "1", "P2PW_RECEIVER_LAUNCH": "spawn"}.items():
    os.environ.setdefault(k, v)

DEFAULT_CASES = "qwen3-4b:tp=2;qwen3-4b:tp=4;qwen3-30b-a3b:tp=2,ep=2;qwen3-30b-a3b:tp=4,ep=4"


def run_case(model: str, spec: str, steps: int, gpus: int, share: bool = False) -> list[dict]:
    import torch

    from p2pweights.baseline.broadcast import BroadcastSender
    from p2pweights.control import SglangEngine
    from p2pweights.models import resolve_model
    from p2pweights.models.checkpoint import checkpoint_tensors, random_tensor
    from p2pweights.receiver import check_weights_equal, start_engine
    from p2pweights.replica import EngineLayout
    from p2pweights.sender import WeightSender

    world = EngineLayout.parse(spec).world_size
    if 1 + world > gpus and not share:
        return [{"model": model, "engine": spec, "skipped": f"needs {1 + world} GPUs, this host has {gpus}"}]
    placement = [(1 + r) % gpus for r in range(world)]
    # NCCL refuses two ranks of one communicator on one GPU: broadcast only when each has its own.
    broadcast_ok = len(set(placement + [0])) == 1 + world
    cfg = resolve_model(model)
    torch.cuda.set_device(0)
    specs = checkpoint_tensors(cfg)
    rows = []
    engine = start_engine(cfg, spec, transport="nixl", name="engine0", startup_timeout=900,
                          env={"P2PW_RECEIVER_GPUS": ",".join(map(str, placement))})
    try:
        client = SglangEngine(engine.url, name="engine0")
        sender = WeightSender(cfg, transport="nixl", buffer_device="cuda:0")
        t0 = time.perf_counter()
        sender.connect([client])
        connect_s = time.perf_counter() - t0
        for step in range(1, steps + 1):
            tensors = [(n, random_tensor(n, s, step).to("cuda:0")) for n, s in specs.items()]
            torch.cuda.synchronize()
            with sender.update(f"p2p-{step}") as u:
                for n, t in tensors:
                    u.push(n, t)
            r = u.report
            equal = check_weights_equal(engine.url, hf_seed=step)["success"] if step == steps else None
            rows.append({"model": model, "engine": spec, "mode": "p2p", "step": step, "seconds": r.seconds,
                         "bytes_per_engine_rank": max(e.bytes for e in r.engines), "loading_s": r.loading_seconds,
                         "connect_s": connect_s, "equal": equal})
            del tensors
        sender.close()
        if not broadcast_ok:
            rows.append({"model": model, "engine": spec, "mode": "broadcast", "skipped": "GPUs shared (--share-gpus)"})
            return rows
        with BroadcastSender([client], backend="nccl") as b:
            for step in range(1, steps + 1):
                seed = 1000 + step
                tensors = [(n, random_tensor(n, s, seed).to("cuda:0")) for n, s in specs.items()]
                torch.cuda.synchronize()
                rep = b.update(tensors, version=f"broadcast-{step}")
                equal = check_weights_equal(engine.url, hf_seed=seed)["success"] if step == steps else None
                rows.append({"model": model, "engine": spec, "mode": "broadcast", "step": step,
                             "seconds": rep.seconds, "bytes_per_engine_rank": rep.bytes, "equal": equal})
                del tensors
    finally:
        engine.close()
    return rows


def main() -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=DEFAULT_CASES, help="model:engine spec, separated by ';' (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--share-gpus", action="store_true",
                   help="a dry run on fewer GPUs: engine ranks share GPUs (P2P only; broadcast needs one GPU per rank)")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "multi_gpu_results.json"))
    a = p.parse_args()
    gpus = torch.cuda.device_count()
    rows = []
    for case in a.cases.split(";"):
        model, spec = case.split(":", 1)
        try:
            rows += run_case(model, spec, a.steps, gpus, a.share_gpus)
        except Exception as e:  # noqa: BLE001 - recorded; the next case runs
            rows.append({"model": model, "engine": spec, "error": f"{type(e).__name__}: {e}"[:2000]})
        with open(a.out, "w") as f:
            json.dump({"gpus": gpus, "rows": rows}, f, indent=1)
        for r in rows[-(2 * a.steps):]:
            print("  " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()), flush=True)
    best: dict[tuple, float] = {}
    for r in rows:
        if "seconds" in r:
            key = (r["model"], r["engine"], r["mode"])
            best[key] = min(best.get(key, float("inf")), r["seconds"])
    print(f"\n{'model':<16} {'engine':<12} {'p2p s':>8} {'broadcast s':>12} {'p2p/bcast':>10}")
    for (model, spec, mode), s in sorted(best.items()):
        if mode == "p2p":
            bc = best.get((model, spec, "broadcast"))
            print(f"{model:<16} {spec:<12} {s:8.3f} {bc if bc else float('nan'):12.3f} {s / bc if bc else float('nan'):10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
