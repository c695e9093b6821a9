"""Where a steady-state update's control plane spends its time: every verb at the sender and inside
the receiver, over several updates of one run (medians).

    PYTHONPATH=python python3 benchmarks/profile_control.py --model qwen3-0.6b --engine tp=2 \\
        --override num_hidden_layers=4 --override vocab_size=4096        # the CPU machine
    # the H200 (what issue 17 measured: Qwen3-4B TP2 into a VRAM receiver over NIXL):
    P2PW_SGLANG_IMPORT_AS_CPU=1 python3 benchmarks/profile_control.py --model qwen3-4b --engine tp=2 \\
        --transport nixl --receiver-device cuda:0 --buffer-device cuda --updates 8

Starts real engines (``receiver.start_engines``: one rank process per engine rank) and one
WeightSender in this process, runs ``--warmup`` updates (the first records copy plans) and then
``--updates`` timed ones, each the same checkpoint under a new version. Per update it records:

  sender       each control verb's round trip (SglangEngine's HTTP call), in the order it ran
  receiver     what a p2pweights receiver says it spent (``p2pw_timings`` in the verb's answer):
               ``server_s`` (the whole call in the leader, lock waits included), the fan-outs to the
               ranks it ran (``ping_s``, ``begin_s``, ``end_s``: leader to every rank and back) and
               each rank's own seconds for them (``*_at_rank_s``: post-processing is ``end``'s)
  update       ``seconds`` (pause returning -> finish returning), ``data_seconds`` (the same start
               -> the last write done), ``control_in_clock_s`` = seconds - data_seconds (the commit),
               the time from ``update()`` to the first slot reaching the writer
               (``start_to_first_write_s``) and how long that slot waited for the sessions to open
               (``first_write_held_s``)

Prints a table (median of the timed updates, milliseconds) and one JSON line ``P2PW_CONTROL {...}``.
Plain Python, no dependency beyond p2pweights'.
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
from typing import Any

try:
    import p2pweights  # noqa: F401  (an installed wheel, e.g. on the GPU machine)
except ImportError:  # from a checkout: the package from source
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
    import p2pweights  # noqa: F401

from p2pweights.control import SglangEngine  # noqa: E402

TIMINGS_KEY = "p2pw_timings"


class TimedEngine(SglangEngine):
    """An SglangEngine that records each call's round trip and the receiver's own timings."""

    calls: list[dict]

    def _json(self, verb: str, **kw: Any) -> Any:
        t0 = time.perf_counter()
        answer = super()._json(verb, **kw)
        rtt = time.perf_counter() - t0
        inside = answer.get(TIMINGS_KEY) if isinstance(answer, dict) else None
        self.calls.append({"verb": verb, "engine": self.name, "start": t0, "rtt_s": rtt, "receiver": inside or {}})
        return answer


def _model(model: str, overrides: list[str], tmp: str) -> str:
    from p2pweights.models import resolve_model
    from p2pweights.models.registry import load_config

    path = resolve_model(model)
    if not overrides:
        return path
    cfg = load_config(path)
    for kv in overrides:
        key, _, raw = kv.partition("=")
        try:
            cfg[key] = json.loads(raw)
        except ValueError:
            cfg[key] = raw
    folder = os.path.join(tmp, "model")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def profile(model: str, engine_spec: str, engines: int, transport: str, receiver_device: str, buffer_device: str,
            updates: int, warmup: int, overrides: list[str]) -> dict:
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
    from p2pweights.receiver import start_engines
    from p2pweights.sender import WeightSender

    tmp = tempfile.mkdtemp(prefix="p2pw-profile-control-")
    cfg = _model(model, overrides, tmp)
    env = {"P2PW_RECEIVER_DEVICE": receiver_device} if receiver_device != "cpu" else {}
    running = start_engines(cfg, engine_spec, count=engines, transport=transport, env=env, startup_timeout=900)
    calls: list[dict] = []
    clients = []
    for e in running:
        c = TimedEngine(e.url, name=e.name)
        c.calls = calls
        clients.append(c)
    from p2pweights.settings import value

    result: dict = {"open_beside_slots": bool(value("P2PW_OPEN_BESIDE_SLOTS")) if _declared("P2PW_OPEN_BESIDE_SLOTS")
                    else None,
                    "model": model, "overrides": overrides, "engine": engine_spec, "engines": engines,
                    "transport": transport, "receiver_device": receiver_device, "buffer_device": buffer_device,
                    "updates": []}
    try:
        tensors = list(random_checkpoint(checkpoint_tensors(cfg), 1))
        if buffer_device != "cpu":
            tensors = [(n, t.to(buffer_device)) for n, t in tensors]
        with WeightSender(cfg, transport=transport, buffer_device=buffer_device) as sender:
            sender.connect(clients)
            for step in range(1, warmup + updates + 1):
                del calls[:]
                t_start = time.perf_counter()
                with sender.update(step) as update:
                    update.push_many(tensors)
                rep = update.report
                if step <= warmup:
                    continue
                gate = getattr(update, "_gate", None)  # sender/open_gate.py (absent before it existed)
                first_write = getattr(gate, "first_submit_at", None)
                result["updates"].append({
                    "step": step, "seconds": rep.seconds, "data_seconds": rep.data_seconds,
                    "bytes": rep.bytes, "control_in_clock_s": rep.seconds - rep.data_seconds,
                    "start_to_first_write_s": (first_write - t_start) if first_write else None,
                    "first_write_held_s": getattr(gate, "held_seconds", None),
                    "verbs": rep.control, "calls": [{**c, "start": c["start"] - t_start} for c in calls]})
    finally:
        for e in running:
            e.close()
        shutil.rmtree(tmp, ignore_errors=True)
    result["summary"] = summarize(result["updates"])
    return result


def _declared(name: str) -> bool:
    from p2pweights.settings import REGISTRY

    return name in REGISTRY


def _median(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarize(updates: list[dict]) -> dict:
    """Medians over the timed updates: per verb (sender round trip, receiver phases), per update."""
    verbs: dict[str, dict[str, list]] = {}
    for u in updates:
        per_update: dict[str, dict[str, float]] = {}
        for c in u["calls"]:
            d = per_update.setdefault(c["verb"], {})
            d["rtt_s"] = max(d.get("rtt_s", 0.0), c["rtt_s"])  # several engines: the slowest
            for k, v in c["receiver"].items():
                if isinstance(v, dict):  # rank -> seconds: the slowest rank
                    v = max(v.values(), default=0.0)
                d[k] = max(d.get(k, 0.0), v)
        for verb, d in per_update.items():
            for k, v in d.items():
                verbs.setdefault(verb, {}).setdefault(k, []).append(v)
    keys = ("seconds", "data_seconds", "control_in_clock_s", "start_to_first_write_s", "first_write_held_s")
    return {"verbs": {v: {k: _median(xs) for k, xs in d.items()} for v, d in verbs.items()},
            "update": {k: _median([u[k] for u in updates]) for k in keys},
            "bytes": updates[0]["bytes"] if updates else 0}


def table(result: dict) -> str:
    s = result["summary"]
    head = (f"{result['model']} {result['engine']} x {result['engines']} engine(s) over {result['transport']}: "
            f"receiver {result['receiver_device']}, slots {result['buffer_device']}; median of "
            f"{len(result['updates'])} steady-state update(s), ms")
    cols = sorted({k for d in s["verbs"].values() for k in d if k != "rtt_s"})
    lines = [head, "", f"{'verb':<26}{'sender rtt':>12}" + "".join(f"{c:>22}" for c in cols)]
    for verb, d in s["verbs"].items():
        lines.append(f"{verb:<26}{_ms(d.get('rtt_s')):>12}" + "".join(f"{_ms(d.get(c)):>22}" for c in cols))
    lines.append("")
    for k, v in s["update"].items():
        lines.append(f"{k:<26}{_ms(v):>12}")
    return "\n".join(lines)


def _ms(x: float | None) -> str:
    return "" if x is None else f"{1e3 * x:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", help="built-in model name or config folder")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="change the model's config.json (e.g. num_hidden_layers=4), repeatable")
    p.add_argument("--engine", default="tp=2", help="engine layout, e.g. tp=2")
    p.add_argument("--engines", type=int, default=1, help="engines (each of --engine's ranks)")
    p.add_argument("--transport", default="mooncake", choices=("mooncake", "nixl"))
    p.add_argument("--receiver-device", default="cpu", help="where the engine ranks keep weights (cpu, cuda:0)")
    p.add_argument("--buffer-device", default="cpu", help="where the sender's slots live (cpu, cuda)")
    p.add_argument("--updates", type=int, default=6, help="timed steady-state updates")
    p.add_argument("--warmup", type=int, default=2, help="updates before them (the first records copy plans)")
    p.add_argument("--json", metavar="FILE", help="also write the whole result there")
    a = p.parse_args(argv)
    result = profile(a.model, a.engine, a.engines, a.transport, a.receiver_device, a.buffer_device, a.updates,
                     a.warmup, a.override)
    print(table(result))
    print("P2PW_CONTROL " + json.dumps({k: v for k, v in result.items() if k != "updates"}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
