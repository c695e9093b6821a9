"""The sender's host path per tensor: ``push`` one call per tensor vs the bulk ``push_many``, at
400, 4,000 and 40,000 tensors (issue "Updates at wire speed at scale", item 2).

    PYTHONPATH=python python3 benchmarks/bench_push.py [--tensors 400,4000,40000] [--updates 4] \\
        [--buffer-device cpu|cuda] [--receiver-device cpu|cuda:0] [--json out.json]

Synthetic Qwen3-MoE shapes with many small experts (hidden 128, expert width 32): per size, the
layers and experts that give about that many HF tensors, so the bytes are small and the host path
(Python per tensor, the copy-plan replay's per-input work) is what is measured, not the copies. One
engine of tp=1 (a p2pweights receiver, real rank process) over Mooncake; one WeightSender; copy plans
recorded before the timed updates (as in a trainer, whose training step leaves the recorder time);
then, alternating, ``--updates`` full updates (delta=False) per mode, the same checkpoint under new
versions, each checked byte for byte at the end.

Columns (medians over the timed updates): ``push`` the wall time of the push calls; ``staging`` and
``loading`` the sender's own account (report times: the checks and staging; the copy-plan replay
into slots); ``host`` = staging + loading, per update and per tensor (the target: <= 5 us per
tensor); ``update`` the whole update (pause to continue). ``host vs wire@50GB/s``: the host path of
that many tensors against the wire time of the same count at Qwen3-235B-A22B's expert shape (one
1536 x 4096 BF16 matrix, 12.6 MB, per tensor) on a 50 GB/s NIC (the target: < 10% at 40,000).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

try:
    import p2pweights  # noqa: F401  (an installed wheel, e.g. on the GPU machine)
except ImportError:  # from a checkout: the package from source
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

from p2pweights.benchmarking.table import emit  # noqa: E402

EXPERT_BYTES = 1536 * 4096 * 2  # one Qwen3-235B-A22B expert matrix in BF16
WIRE_BPS = 50e9
MODES = ("push", "push_many")
COLUMNS = [
    ("tensors", "tensors", "d"), ("mode", "mode", ""), ("push_ms", "push ms", ".1f"),
    ("staging_ms", "staging ms", ".1f"), ("loading_ms", "loading ms", ".1f"), ("host_ms", "host ms", ".1f"),
    ("us_per_tensor", "host us/tensor", ".2f"), ("update_ms", "update ms", ".1f"),
    ("host_vs_wire", "host vs wire@50GB/s", ".2%"), ("equal", "equal", ""),
]


def synthetic_config(tensors: int, folder: str) -> tuple[str, int, int]:
    """A Qwen3-MoE config.json with about ``tensors`` HF tensors: (folder, layers, experts)."""
    from p2pweights.models import resolve_model
    from p2pweights.models.registry import load_config

    per_layer_fixed, outside = 8, 3  # attention + norms per layer; embed, norm, lm_head
    layers = max(1, min(48, round((tensors / 1536) ** 0.5 * 8)))  # deeper as it grows, as real MoEs are
    experts = max(2, round((tensors - outside) / layers - per_layer_fixed) // 3)
    cfg = load_config(resolve_model("qwen3-30b-a3b"))
    cfg.update(num_hidden_layers=layers, num_experts=experts, num_experts_per_tok=2, hidden_size=128,
               moe_intermediate_size=32, intermediate_size=128, head_dim=32, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=512, bos_token_id=0, eos_token_id=1)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder, layers, experts


def run_size(tensors: int, updates: int, buffer_device: str, receiver_device: str, log) -> list[dict]:
    from p2pweights.control import SglangEngine
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
    from p2pweights.receiver import check_weights_equal, start_engines
    from p2pweights.sender import WeightSender

    tmp = tempfile.mkdtemp(prefix="p2pw-bench-push-")
    cfg, layers, experts = synthetic_config(tensors, os.path.join(tmp, "model"))
    env = {"P2PW_RECEIVER_DEVICE": receiver_device} if receiver_device != "cpu" else {}
    engines = start_engines(cfg, "tp=1", count=1, transport="mooncake", env=env, startup_timeout=1800)
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        ckpt = list(random_checkpoint(checkpoint_tensors(cfg), 1))
        if buffer_device != "cpu":
            ckpt = [(n, t.to(buffer_device)) for n, t in ckpt]
        n = len(ckpt)
        log(f"{n} tensors ({layers} layers x {experts} experts), {sum(t.nbytes for _, t in ckpt) / 1e6:.1f} MB")
        with WeightSender(cfg, transport="mooncake", buffer_device=buffer_device) as sender:
            t0 = time.perf_counter()
            sender.connect([SglangEngine(e.url, name=e.name) for e in engines])
            if sender.recorder is not None:
                sender.recorder.wait(1800)
            log(f"connect + copy plans: {time.perf_counter() - t0:.1f} s")
            step = 0
            for i in range(updates + 1):  # the first round warms both modes up
                for mode in MODES:
                    step += 1
                    with sender.update(step, delta=False) as update:
                        t1 = time.perf_counter()
                        if mode == "push":
                            for name, t in ckpt:
                                update.push(name, t)
                        else:
                            update.push_many(ckpt)
                        push_s = time.perf_counter() - t1
                    if i == 0:
                        continue
                    rep, times = update.report, update.times
                    host = times.staging + times.loading
                    rows[mode].append({"push_ms": 1e3 * push_s, "staging_ms": 1e3 * times.staging,
                                       "loading_ms": 1e3 * times.loading, "host_ms": 1e3 * host,
                                       "update_ms": 1e3 * rep.seconds, "replayed": times.replayed,
                                       "loader_groups": times.loader_groups})
            equal = check_weights_equal(engines[0].url, 1).get("success")
    finally:
        for e in engines:
            e.close()
        shutil.rmtree(tmp, ignore_errors=True)
    out = []
    for mode in MODES:
        med = {k: statistics.median(r[k] for r in rows[mode]) for k in rows[mode][0]}
        out.append({"tensors": n, "mode": mode, **med, "us_per_tensor": 1e3 * med["host_ms"] / n,
                    "host_vs_wire": (med["host_ms"] / 1e3) / (n * EXPERT_BYTES / WIRE_BPS),
                    "equal": bool(equal), "updates": len(rows[mode]), "buffer_device": buffer_device,
                    "receiver_device": receiver_device})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tensors", default="400,4000,40000", help="comma-separated sizes (HF tensors per update)")
    p.add_argument("--updates", type=int, default=4, help="timed updates per mode and size")
    p.add_argument("--buffer-device", default="cpu", help="where the sender's slots live: cpu or cuda")
    p.add_argument("--receiver-device", default="cpu", help="where the engine rank keeps weights: cpu or cuda:0")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    a = p.parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    rows = []
    for size in (int(s) for s in a.tensors.split(",")):
        rows += run_size(size, a.updates, a.buffer_device, a.receiver_device, log)
    emit(f"host path per tensor: slots {a.buffer_device}, receiver {a.receiver_device}", COLUMNS, rows,
         as_json=a.json)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
