"""The fixed control cost of one update on p2pweights receivers (issue 24, item 6), both ways in
one run: what pause, begin and end cost when a receiver's ranks fold the ping into the session
verbs, take the deltas with the end and skip sglang's update hooks once proven no-ops (``folded``,
the default), against the same engine with ``P2PW_RECEIVER_CONTROL=separate`` (a ping of every
rank before begin and end, the deltas in a call of their own, the hooks at every session).

    PYTHONPATH=python python3 benchmarks/bench_control_cost.py --model qwen3-0.6b --engine tp=2 \\
        --override num_hidden_layers=4 --override vocab_size=4096           # the CPU machine
    # the H200 (what issue 24 measured: Qwen3-4B TP2 into a VRAM receiver over NIXL):
    P2PW_SGLANG_IMPORT_AS_CPU=1 python3 benchmarks/bench_control_cost.py --model qwen3-4b --engine tp=2 \\
        --transport nixl --receiver-device cuda:0 --buffer-device cuda

Starts two engines of the same layout (rank processes spawned, each with its mode), then runs,
alternating between them so that both see the same machine load:

  sessions   the control plane alone: ``UpdateSession`` open (pause, begin), the check-in, commit
             (end, which bumps the version and continues in the same call), no writes
  updates    one ``WeightSender`` per engine doing steady updates of one checkpoint (deltas on by
             default: after the first, the end carries every rank's delta manifest), each update's
             engine checked equal to the checkpoint at the end

For each verb: the sender's round trip and the receiver's own phases (``p2pw_timings``: the leader's
whole call, its fan-outs to the ranks, each rank's own seconds), medians in ms, and the fixed cost
per update = pause + begin + end round trips (the check-in runs beside the last writes). Also what
the control plane's bodies cost to encode and decode with the annotations read once and read at
every call (before this change: that part runs in both engines here, so it is measured apart, in
this process). Prints the tables, then one JSON line ``P2PW_CONTROL_COST {...}``.
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
import timeit
import typing
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from profile_control import TimedEngine, _model  # noqa: E402  (this folder's profiler: the same timed client)

MODES = ("separate", "folded")
FIXED = ("pause_generation", "begin_weight_update", "end_weight_update")
PHASES = ("server_s", "ping_s", "begin_s", "end_s", "apply_deltas_s", "begin_at_rank_s", "end_at_rank_s",
          "apply_deltas_at_rank_s", "update_weight_version_s", "continue_generation_s")


def _per_verb(calls: list[dict]) -> dict[str, dict[str, float]]:
    """verb -> {rtt_s, <receiver phase>: s} of one update (a rank phase: its slowest rank)."""
    out: dict[str, dict[str, float]] = {}
    for c in calls:
        d = out.setdefault(c["verb"], {})
        d["rtt_s"] = d.get("rtt_s", 0.0) + c["rtt_s"]
        for k, v in c["receiver"].items():
            d[k] = max(v.values(), default=0.0) if isinstance(v, dict) else v
    return out


def _medians(rows: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    keys = {(v, k) for r in rows for v, d in r.items() for k in d}
    return {v: {k: statistics.median([r[v][k] for r in rows if k in r.get(v, {})])
                for (v2, k) in sorted(keys) if v2 == v} for v in sorted({v for v, _ in keys})}


def _fixed(verbs: dict[str, dict[str, float]]) -> float:
    return sum(verbs.get(v, {}).get("rtt_s", 0.0) for v in FIXED)


def run_sessions(clients: dict[str, TimedEngine], calls: list, rounds: int, warmup: int) -> dict:
    from p2pweights.control import UpdateSession

    rows: dict[str, list] = {m: [] for m in MODES}
    walls: dict[str, list] = {m: [] for m in MODES}
    for i in range(warmup + rounds):
        for mode in MODES if i % 2 == 0 else MODES[::-1]:  # alternate who goes first
            del calls[:]
            session = UpdateSession(clients[mode], version=f"s{i}")
            t0 = time.perf_counter()
            session.open()
            t1 = time.perf_counter()
            session.check_in_soon()
            time.sleep(0.005)  # the writes' place: the check-in runs beside them
            t2 = time.perf_counter()
            session.commit()
            t3 = time.perf_counter()
            if i >= warmup:
                rows[mode].append(_per_verb(calls))
                walls[mode].append({"open_s": t1 - t0, "commit_s": t3 - t2})
    return {m: {"verbs": _medians(rows[m]),
                "open_s": statistics.median(w["open_s"] for w in walls[m]),
                "commit_s": statistics.median(w["commit_s"] for w in walls[m]),
                "fixed_s": statistics.median(_fixed(r) for r in rows[m]), "n": len(rows[m])} for m in MODES}


def run_updates(cfg: str, clients: dict[str, TimedEngine], calls: list, transport: str, buffer_device: str,
                updates: int, warmup: int, delta: Any, urls: dict[str, str], check: bool = True) -> dict:
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
    from p2pweights.receiver import check_weights_equal
    from p2pweights.sender import WeightSender

    seed = 7
    tensors = list(random_checkpoint(checkpoint_tensors(cfg), seed))
    if buffer_device != "cpu":
        tensors = [(n, t.to(buffer_device)) for n, t in tensors]
    senders = {m: WeightSender(cfg, transport=transport, buffer_device=buffer_device) for m in MODES}
    rows: dict[str, list] = {m: [] for m in MODES}
    reports: dict[str, list] = {m: [] for m in MODES}
    equal: dict[str, bool] = {}
    try:
        for m in MODES:
            senders[m].connect([clients[m]])
        for step in range(1, warmup + updates + 1):
            for mode in MODES if step % 2 else MODES[::-1]:
                del calls[:]
                with senders[mode].update(step, delta=delta) as u:
                    u.push_many(tensors)
                rep = u.report
                if step > warmup:
                    rows[mode].append(_per_verb(calls))
                    reports[mode].append({"seconds": rep.seconds, "data_seconds": rep.data_seconds,
                                          "control": dict(rep.control), "bytes": rep.bytes,
                                          "bytes_written": getattr(rep, "bytes_written", rep.bytes)})
        for m in MODES:  # every byte the updates wrote, as sglang's loaders would have put it
            equal[m] = bool(check_weights_equal(urls[m], hf_seed=seed)["success"]) if check else None
    finally:
        for s in senders.values():
            s.close()
    out = {}
    for m in MODES:
        control = {k: statistics.median(r["control"].get(k, 0.0) for r in reports[m])
                   for k in sorted({k for r in reports[m] for k in r["control"]})}
        out[m] = {"verbs": _medians(rows[m]), "fixed_s": statistics.median(_fixed(r) for r in rows[m]),
                  "report_control_s": control, "n": len(rows[m]), "equal": equal[m],
                  **{k: statistics.median(r[k] for r in reports[m]) for k in ("seconds", "data_seconds")},
                  "bytes": reports[m][0]["bytes"], "bytes_written": reports[m][0]["bytes_written"]}
    return out


def bodies_cost(number: int = 2000) -> dict[str, float]:
    """Microseconds to encode an answer and decode a request body, with the annotations read once
    (now) and read at every call (``typing.get_type_hints``, as before)."""
    from p2pweights.control import bodies

    def per_call() -> dict[str, float]:
        return {"encode_ack_us": 1e6 * timeit.timeit(lambda: bodies.encode(bodies.Ack()), number=number) / number,
                "decode_begin_us": 1e6 * timeit.timeit(
                    lambda: bodies.decode(bodies.BeginWeightUpdateReq, {"selector": "all"}), number=number) / number}
    cached = per_call()
    kept = bodies._hints
    bodies._hints = typing.get_type_hints  # type: ignore[assignment]  # the annotations read at every call
    try:
        every = per_call()
    finally:
        bodies._hints = kept
    return {**{f"{k}_cached": v for k, v in cached.items()}, **{f"{k}_every_call": v for k, v in every.items()}}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1e3 * x:.2f}"


def table(title: str, result: dict) -> str:
    sep, fol = result["separate"], result["folded"]
    lines = [title, "", f"{'verb / phase (ms, median)':<44}{'separate':>10}{'folded':>10}{'ratio':>8}"]
    for verb in sorted(set(sep["verbs"]) | set(fol["verbs"]), key=lambda v: (v not in FIXED, v)):
        for k in ("rtt_s", *PHASES):
            a, b = sep["verbs"].get(verb, {}).get(k), fol["verbs"].get(verb, {}).get(k)
            if a is None and b is None:
                continue
            name = verb if k == "rtt_s" else f"  {k.removesuffix('_s')}"
            ratio = f"{b / a:.2f}" if a and b is not None else "-"
            lines.append(f"{name:<44}{_ms(a):>10}{_ms(b):>10}{ratio:>8}")
    for k in ("fixed_s", "open_s", "commit_s", "seconds", "data_seconds"):
        if k in sep:
            a, b = sep[k], fol[k]
            label = "fixed cost: pause + begin + end" if k == "fixed_s" else k
            lines.append(f"{label:<44}{_ms(a):>10}{_ms(b):>10}{b / a if a else 0:>8.2f}")
    if "report_control_s" in sep:
        lines.append("report.control (the update's own log of each verb):")
        for k in sorted(set(sep["report_control_s"]) | set(fol["report_control_s"])):
            a, b = sep["report_control_s"].get(k), fol["report_control_s"].get(k)
            lines.append(f"  {k:<42}{_ms(a):>10}{_ms(b):>10}")
        lines.append(f"{'equal to the checkpoint':<44}{str(sep['equal']):>10}{str(fol['equal']):>10}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b", help="built-in model name or config folder")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="change the model's config.json (e.g. num_hidden_layers=4), repeatable")
    p.add_argument("--engine", default="tp=2", help="engine layout, e.g. tp=2")
    p.add_argument("--transport", default="mooncake", choices=("mooncake", "nixl"))
    p.add_argument("--receiver-device", default="cpu", help="where the engine ranks keep weights (cpu, cuda:0)")
    p.add_argument("--buffer-device", default="cpu", help="where the senders' slots live (cpu, cuda)")
    p.add_argument("--sessions", type=int, default=30, help="timed control-only sessions per mode (0: none)")
    p.add_argument("--updates", type=int, default=6, help="timed steady updates per mode (0: none)")
    p.add_argument("--warmup", type=int, default=2, help="sessions / updates before them (the first proves the hooks)")
    p.add_argument("--delta", default="auto", choices=("auto", "off"), help="the updates' deltas (off: full writes)")
    p.add_argument("--check", default="equal", choices=("equal", "none"),
                   help="after the updates, each engine's equality check against sglang's loader (none: skip it)")
    p.add_argument("--json", metavar="FILE", help="also write the whole result there")
    a = p.parse_args(argv)

    from p2pweights.receiver import start_engine

    tmp = tempfile.mkdtemp(prefix="p2pw-control-cost-")
    cfg = _model(a.model, a.override, tmp)
    env = {"P2PW_RECEIVER_DEVICE": a.receiver_device} if a.receiver_device != "cpu" else {}
    engines, calls = {}, []
    result: dict = {"model": a.model, "overrides": a.override, "engine": a.engine, "transport": a.transport,
                    "receiver_device": a.receiver_device, "buffer_device": a.buffer_device}
    try:
        for mode in MODES:  # spawned: each engine's ranks get their own mode (a fork launcher has one environment)
            engines[mode] = start_engine(cfg, a.engine, transport=a.transport, name=mode, launch="spawn",
                                         env={**env, "P2PW_RECEIVER_CONTROL": mode}, startup_timeout=900)
        clients = {}
        for mode, e in engines.items():
            clients[mode] = TimedEngine(e.url, name=mode)
            clients[mode].calls = calls
        if a.sessions:
            result["sessions"] = run_sessions(clients, calls, a.sessions, a.warmup)
            print(table(f"control only: {a.model} {a.engine} over {a.transport}, receiver {a.receiver_device}, "
                        f"median of {a.sessions} sessions per mode", result["sessions"]), flush=True)
            print()
        if a.updates:
            result["updates"] = run_updates(cfg, clients, calls, a.transport, a.buffer_device, a.updates, a.warmup,
                                            False if a.delta == "off" else "auto",
                                            {m: e.url for m, e in engines.items()}, check=a.check == "equal")
            print(table(f"steady updates: {a.model} {a.engine} over {a.transport}, receiver {a.receiver_device}, "
                        f"slots {a.buffer_device}, delta {a.delta}, median of {a.updates} per mode",
                        result["updates"]), flush=True)
            print()
    finally:
        for e in engines.values():
            e.close()
        shutil.rmtree(tmp, ignore_errors=True)
    result["bodies_us"] = bodies_cost()
    b = result["bodies_us"]
    print(f"bodies (us per call, this process): encode Ack {b['encode_ack_us_every_call']:.1f} -> "
          f"{b['encode_ack_us_cached']:.1f}, decode begin {b['decode_begin_us_every_call']:.1f} -> "
          f"{b['decode_begin_us_cached']:.1f} (annotations read at every call -> once)")
    print("P2PW_CONTROL_COST " + json.dumps(result), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    ok = all(r["equal"] is not False for r in result.get("updates", {}).values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
