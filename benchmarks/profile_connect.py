"""Where a `WeightSender.connect` spends its time: every phase of a cold and of warm connects.

    PYTHONPATH=python python3 benchmarks/profile_connect.py --model qwen3-0.6b --engine tp=1
    # on the H200 (see benchmarks/RESULTS.md, "Connect phases"):
    python3 benchmarks/profile_connect.py --model qwen3-4b --engine tp=2 --transport nixl \\
        --receiver-device cuda:0 --buffer-device cuda

Starts a real engine (``receiver.start_engine``: one rank process per GPU of the layout) and, in this
one process, times:

  import       torch and p2pweights (a trainer has them already); sglang is imported by the cold
               connect (its "sglang_import_s"), or before it with --import-first, or by the sender's
               warm-up with --prepare-lead S: WeightSender(prepare=True), then S seconds of the
               trainer's own start-up (sleeping here), then the cold connect
  cold         the first connect: replicas built (model on meta + loader probe), transport agent
               created, slots allocated, pinned and registered, publications fetched and checked,
               peers connected
  warm         the same sender connecting again to the same engine (nothing should be rebuilt,
               re-registered, or re-created), once the cold connect's background copy-plan recorder
               ended (a reconnect stops it after its current group: its wait is not the connect's)
  new sender   a second WeightSender of the same process (replicas shared: invariant 7)
  disk cache   a sender with a fresh ModelReplicas reading P2PW_REPLICA_CACHE_DIR (no probe)
  fresh process, disk cache   the same in a new interpreter: what a restarted trainer pays

Each connect's phases come from ``sender.connect_phases`` (sender/connect_report.py). Prints a table
(seconds per phase; counts of builds, agents, registrations, peer connects), then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

T0 = time.perf_counter()
import torch  # noqa: E402,F401  (timed: a trainer has it imported already)

T_TORCH = time.perf_counter() - T0
T1 = time.perf_counter()
try:
    import p2pweights  # noqa: F401  (an installed wheel, e.g. on the GPU machine)
except ImportError:  # from a checkout: the package from source
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
    import p2pweights  # noqa: F401

T_P2PW = time.perf_counter() - T1
COLUMNS = ("cold", "warm", "new sender", "disk cache", "fresh process, disk cache")
SHORT = {"fresh process, disk cache": "fresh+disk"}
# a cold connect in a new interpreter that finds the replicas in the disk cache (no probe, no build)
FRESH = r"""
import json, sys, time
t = time.perf_counter()
import torch  # noqa: F401
from p2pweights.control import SglangEngine
from p2pweights.replica import ModelReplicas
from p2pweights.sender import WeightSender
imports = time.perf_counter() - t
model, cache, url, transport, device = sys.argv[1:6]
with WeightSender(model, transport=transport, buffer_device=device, replicas=ModelReplicas(cache_dir=cache)) as s:
    s.connect([SglangEngine(url, name="engine0")])
    r = s.connect_phases.as_json()
r["sglang_imported"] = "sglang" in sys.modules
r["imports_s"] = imports
print("P2PW_FRESH " + json.dumps(r))
"""


def profile(model: str, engine_spec: str, transport: str, receiver_device: str, buffer_device: str,
            repeat_warm: int = 3, import_first: bool = False, prepare_lead: float | None = None) -> dict:
    from p2pweights.control import SglangEngine
    from p2pweights.models import resolve_model
    from p2pweights.receiver import start_engine
    from p2pweights.replica import ModelReplicas, sglang_env
    from p2pweights.sender import WeightSender

    cfg = resolve_model(model)
    env = {"P2PW_RECEIVER_DEVICE": receiver_device} if receiver_device != "cpu" else {}
    t = time.perf_counter()
    engine = start_engine(cfg, engine_spec, transport=transport, name="engine0", env=env, startup_timeout=900)
    result: dict = {"model": model, "engine": engine_spec, "transport": transport, "receiver_device": receiver_device,
                    "buffer_device": buffer_device, "engine_start_s": time.perf_counter() - t,
                    "import_s": {"torch": T_TORCH, "p2pweights": T_P2PW}, "connects": {}}
    senders = []
    cache = tempfile.mkdtemp(prefix="p2pw-connect-cache-")
    try:
        if buffer_device != "cpu":  # a trainer's process has its CUDA context before it connects
            import torch

            t = time.perf_counter()
            torch.empty(1, device=buffer_device)
            torch.cuda.synchronize()
            result["import_s"]["cuda context"] = time.perf_counter() - t
        if import_first:
            t = time.perf_counter()
            sglang_env.prepare()
            result["import_s"]["sglang"] = time.perf_counter() - t
        replicas = ModelReplicas(cache_dir=cache)

        def connect(sender) -> dict:
            sender.connect([SglangEngine(engine.url, name="engine0")])
            return sender.connect_phases.as_json()

        first = WeightSender(cfg, transport=transport, buffer_device=buffer_device, replicas=replicas,
                             **({"prepare": True} if prepare_lead is not None else {}))  # older trees: no keyword
        senders.append(first)
        if prepare_lead is not None:  # the trainer's own start-up while the warm-up runs (sender/warmup.py)
            warmup = first._warmup
            time.sleep(prepare_lead)
            result["prepare"] = {"lead_s": prepare_lead, "warmup_done_at_connect": warmup.done()}
        result["connects"]["cold"] = connect(first)
        if first.recorder is not None:  # copy plans recorded in the background after connect (P2PW_COPY_PLANS):
            t = time.perf_counter()  # a reconnect stops the recorder after its current group (seconds for a
            first.recorder.wait()  # large embedding on a CPU), so the warm connects are measured after it
            result["recording_after_cold_s"] = time.perf_counter() - t
        if prepare_lead is not None:
            result["prepare"]["warmup_s"] = warmup.seconds
        warm = [connect(first) for _ in range(repeat_warm)]
        result["connects"]["warm"] = min(warm, key=lambda r: r["total_s"])
        second = WeightSender(cfg, transport=transport, buffer_device=buffer_device, replicas=replicas)
        senders.append(second)
        result["connects"]["new sender"] = connect(second)
        from_disk = WeightSender(cfg, transport=transport, buffer_device=buffer_device,
                                 replicas=ModelReplicas(cache_dir=cache))
        senders.append(from_disk)
        result["connects"]["disk cache"] = connect(from_disk)
        import subprocess

        proc = subprocess.run([sys.executable, "-c", FRESH, cfg, cache, engine.url, transport, buffer_device],
                              capture_output=True, text=True, timeout=900)
        fresh = [ln for ln in proc.stdout.splitlines() if ln.startswith("P2PW_FRESH ")]
        if fresh:
            result["connects"]["fresh process, disk cache"] = json.loads(fresh[0][len("P2PW_FRESH "):])
        else:
            result["fresh_error"] = proc.stderr[-2000:]
    finally:
        for s in senders:
            s.close()
        engine.close()
        shutil.rmtree(cache, ignore_errors=True)
    return result


def rows(result: dict) -> list[dict]:
    """Flat rows (benchmarks/gpu/bench_gpu.py's section format): the imports, then one per connect."""
    out = [{"model": result["model"], "engine": result["engine"], "transport": result["transport"],
            "engine_start_s": result["engine_start_s"], **{f"import {k} s": v for k, v in result["import_s"].items()}}]
    for name, r in result["connects"].items():
        out.append({"connect": name, "total_s": r["total_s"], **{f"{k} s": v for k, v in r["phases_s"].items()},
                    **{f"replica {k}": v for k, v in r["replica_s"].items()},
                    **{f"beside replicas {k} s": v for k, v in r.get("overlapped_s", {}).items()}, **r["counts"]})
    return out


def table(result: dict) -> str:
    from p2pweights.sender.connect_report import COUNTS, PHASES

    cols = [c for c in COLUMNS if c in result["connects"]]
    runs = [result["connects"][c] for c in cols]
    head = f"{result['model']} {result['engine']} over {result['transport']}: receiver {result['receiver_device']}, " \
           f"slots {result['buffer_device']}; engine start {result['engine_start_s']:.1f} s"
    imports = ", ".join(f"{k} {v:.2f} s" for k, v in result["import_s"].items())
    if "prepare" in result:
        w = result["prepare"]
        imports += (f"; warm-up (prepare=True) {w.get('warmup_s') or 0:.2f} s, started {w['lead_s']:.1f} s before the "
                    f"cold connect ({'done' if w['warmup_done_at_connect'] else 'not done'} by then)")
    if "recording_after_cold_s" in result:
        imports += f"; warm connects measured after the plan recorder ended ({result['recording_after_cold_s']:.2f} s)"
    lines = [head, f"imports before the cold connect: {imports}", "",
             f"{'phase (s)':<34}" + "".join(f"{SHORT.get(c, c):>12}" for c in cols)]
    replica_keys = sorted({k for r in runs for k in r["replica_s"]})
    for phase in PHASES:
        if any(phase in r["phases_s"] for r in runs):
            lines.append(f"{phase:<34}" + "".join(f"{r['phases_s'].get(phase, 0.0):>12.4f}" for r in runs))
        if phase == "replicas":
            for k in replica_keys:
                lines.append(f"{'  of which ' + k:<34}" + "".join(f"{r['replica_s'].get(k, 0.0):>12.4f}" for r in runs))
    for k in sorted({k for r in runs for k in r.get("overlapped_s", {})}):
        lines.append(f"{'beside replicas: ' + k:<34}" + "".join(f"{r['overlapped_s'].get(k, 0.0):>12.4f}" for r in runs))
    lines.append(f"{'total':<34}" + "".join(f"{r['total_s']:>12.4f}" for r in runs))
    lines.append(f"{'sglang imported by it':<34}" + "".join(
        f"{str(r.get('sglang_imported', '')):>12}" for r in runs))
    lines.append("")
    for what in COUNTS:
        lines.append(f"{what:<34}" + "".join(f"{r['counts'].get(what, 0):>12d}" for r in runs))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", help="built-in model name or config folder")
    p.add_argument("--engine", default="tp=1", help="engine layout, e.g. tp=2")
    p.add_argument("--transport", default="mooncake", choices=("mooncake", "nixl"))
    p.add_argument("--receiver-device", default="cpu", help="where the engine ranks keep weights (cpu, cuda:0)")
    p.add_argument("--buffer-device", default="cpu", help="where the sender's slots live (cpu, cuda)")
    p.add_argument("--repeat-warm", type=int, default=3, help="warm connects (the fastest is shown)")
    p.add_argument("--import-first", action="store_true",
                   help="import sglang before the cold connect (default: inside it, as a trainer's first connect)")
    p.add_argument("--prepare-lead", type=float, metavar="S",
                   help="WeightSender(prepare=True), then S seconds before the cold connect (a trainer's start-up)")
    p.add_argument("--json", metavar="FILE", help="also write the result there")
    a = p.parse_args(argv)
    result = profile(a.model, a.engine, a.transport, a.receiver_device, a.buffer_device, a.repeat_warm, a.import_first,
                     a.prepare_lead)
    print(table(result))
    print("P2PW_CONNECT " + json.dumps(result), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
