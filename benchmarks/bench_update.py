"""P2P vs broadcast seconds per update, both transports, in one run (issue: end to end).

    PYTHONPATH=python python3 benchmarks/bench_update.py [--model qwen3-0.6b] [--steps 3] [--json]

Default: Qwen3-0.6B shapes, 2 engines x TP2, 2 senders; P2P over Mooncake, P2P over NIXL and the
broadcast baseline (gloo) against the same engines' layout; every step checked byte for byte.
Targets: P2P <= 0.5 x broadcast; time outside loaders and writes <= 10% of a P2P step.
"""
from __future__ import annotations

import argparse
import sys

from p2pweights.benchmarking.table import emit
from p2pweights.commands.demo_run import results_json, run_demo
from p2pweights.models import resolve_model

COLUMNS = [
    ("mode", "mode", ""), ("transport", "transport", ""), ("step", "step", "d"), ("size", "bytes/engine rank", ""),
    ("seconds", "seconds", ".3f"), ("gbps", "GB/s", ".3f"), ("outside", "outside", ".1%"), ("equal", "equal", ""),
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--engine", default="tp=2")
    p.add_argument("--senders", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    model = resolve_model(a.model)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    results = []
    for i, transport in enumerate(("mooncake", "nixl")):
        modes = ("p2p", "broadcast") if i == 0 else ("p2p",)
        results += run_demo(model, engines=a.engines, engine=a.engine, senders=a.senders, steps=a.steps,
                            transport=transport, modes=modes, progress=log)
    from p2pweights.settings import format_size

    rows = [{**r, "size": format_size(r["bytes"]), "outside": r["outside_fraction"], "equal": str(r["equal"])}
            for r in results_json(results)["steps"]]
    best = {}
    for r in results:
        key = (r.mode, r.transport)
        best[key] = min(best.get(key, float("inf")), r.seconds)
    bc = best[("broadcast", "gloo")]
    ratios = {f"{t} p2p / broadcast": best[("p2p", t)] / bc for t in ("mooncake", "nixl")}
    outside = max(r.outside_fraction for r in results if r.mode == "p2p" and r.step > 1) if a.steps > 1 else None
    footer = "# best of steps: " + ", ".join(f"{k} = {v:.2f}" for k, v in ratios.items()) + " (target <= 0.5)"
    if outside is not None:
        footer += f"\n# worst time outside loaders and writes after step 1: {outside:.1%} (target <= 10%)"
    footer += "\n# " + ("OK" if all(r.equal for r in results) else "FAILED") + ": every step byte-exact on every engine rank"
    emit(f"p2pweights update: {a.model}, {a.engines} engines x {a.engine}, {a.senders} senders", COLUMNS, rows,
         as_json=a.json, footer=footer, extra={"ratios": ratios, "outside_max": outside} if a.json else None)
    return 0 if all(r.equal for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
