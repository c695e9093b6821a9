"""Connect cost of a sender: build (or reuse) the meta replica of one engine rank and probe its loaders.

    PYTHONPATH=python python3 benchmarks/bench_connect.py [--json] [--repeat N]

Cases (the built-in config.json shapes, p2pweights/models/, no weights):
  Qwen3-30B-A3B, TP8/EP8, rank 3        targets: cold <= 5 s, warm <= 0.5 s
  DeepSeek-V3,   TP8/EP8/DP-attention 8, rank 5

Columns: cold = build the meta model + probe its loaders over every HF tensor + parameter groups;
warm = the same layout again in this process (the in-memory replica); disk = a fresh
``ModelReplicas`` that finds the mapping in its on-disk cache (no probe; the meta model is built
lazily at the first group, which the last column times). sglang's import (once per process) is
reported separately. Checked: every parameter is reached by an HF tensor (the probe refuses
otherwise), the rank's parameter bytes, and that the disk mapping equals the cold one.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

from p2pweights.benchmarking.table import emit, machine  # noqa: E402

# (name, model: a built-in name or a config folder, engine spec, engine rank)
CASES = [
    ("Qwen3-30B-A3B", "qwen3-30b-a3b", "tp=8,ep=8", 3),
    ("DeepSeek-V3", "deepseek-v3", "tp=8,ep=8,dp_attention=8", 5),
]
TARGETS = {"Qwen3-30B-A3B": (5.0, 0.5)}


def run_case(name: str, model: str, spec: str, rank: int) -> dict:
    from p2pweights.models import resolve_model
    from p2pweights.replica import EngineLayout, ModelReplicas

    config = resolve_model(model)
    engine = EngineLayout.parse(spec)
    with tempfile.TemporaryDirectory() as cache_dir:
        replicas = ModelReplicas(cache_dir=cache_dir)
        t0 = time.perf_counter()
        replica = replicas.get(config, engine, rank)
        cold = time.perf_counter() - t0
        timings = dict(replicas.last_timings)
        t0 = time.perf_counter()
        again = replicas.get(config, engine, rank)
        warm = time.perf_counter() - t0
        assert again is replica and replicas.builds == 1

        fresh = ModelReplicas(cache_dir=cache_dir)
        t0 = time.perf_counter()
        cached = fresh.get(config, engine, rank)
        disk = time.perf_counter() - t0
        assert fresh.builds == 0 and fresh.disk_hits == 1
        assert cached.mapping.sources == replica.mapping.sources, "disk mapping differs from the probe's"
        t0 = time.perf_counter()
        cached.model  # noqa: B018  (the lazy meta build a disk hit defers to the first group)
        lazy = time.perf_counter() - t0

    built = {n: p.numel() * p.element_size() for n, p in replica.model.named_parameters()}
    assert built == replica.param_nbytes_all(), "parameter bytes differ from the meta model"
    assert all(replica.mapping.sources[n] for n in built), "a parameter no HF tensor reaches"
    return {
        "model": name,
        "engine": engine.describe(),
        "rank": rank,
        "hf_tensors": len(replica.hf_specs),
        "params": len(built),
        "groups": len(replica.groups),
        "rank_gb": sum(built.values()) / 1e9,
        "largest_group_mb": replica.largest_group_nbytes / 1e6,
        "build_s": timings["build_s"],
        "probe_s": timings["probe_s"],
        "cold_s": cold,
        "warm_s": warm,
        "disk_s": disk,
        "lazy_build_s": lazy,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case; the median row is kept")
    args = parser.parse_args()

    from p2pweights.replica import sglang_env

    t0 = time.perf_counter()
    sglang_env.prepare()
    import_s = time.perf_counter() - t0

    rows = []
    for case in CASES:
        runs = [run_case(*case) for _ in range(args.repeat)]
        runs.sort(key=lambda r: r["cold_s"])
        rows.append(runs[len(runs) // 2])
    verdicts = []
    for row in rows:
        cold_max, warm_max = TARGETS.get(row["model"], (None, None))
        if cold_max is not None:
            ok = row["cold_s"] <= cold_max and row["warm_s"] <= warm_max
            verdicts.append(f"{row['model']}: cold {row['cold_s']:.2f} s (target <= {cold_max}), "
                            f"warm {row['warm_s'] * 1e3:.2f} ms (target <= {warm_max * 1e3:.0f} ms): {'OK' if ok else 'MISSED'}")
    columns = [
        ("model", "model", ""), ("engine", "engine", ""), ("rank", "rank", ""),
        ("hf_tensors", "HF tensors", ""), ("params", "params", ""), ("groups", "groups", ""),
        ("rank_gb", "rank GB", ".3f"), ("largest_group_mb", "largest group MB", ".1f"),
        ("build_s", "build s", ".2f"), ("probe_s", "probe s", ".2f"), ("cold_s", "cold s", ".2f"),
        ("warm_s", "warm s", ".6f"), ("disk_s", "disk s", ".3f"), ("lazy_build_s", "lazy build s", ".2f"),
    ]
    footer = f"# sglang import (once per process): {import_s:.1f} s\n# " + "\n# ".join(verdicts)
    emit("connect cost: meta replica + loader probe per engine rank", columns, rows, as_json=args.json,
         footer=footer, extra={"import_s": import_s, "machine": machine(), "verdicts": verdicts} if args.json else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
