"""Merged or adapter: the bytes one update moves to one engine, per built-in model (issue "LoRA
adapters", item 3; docs/lora.md, "Merged or adapter: the bytes moved").

    PYTHONPATH=python python3 benchmarks/bench_lora_bytes.py [--ranks 16,64] [--json]

A merged update (the adapter folded into the base weights, pushed as full weights) writes every
engine rank's weights: the model's bytes. An adapter update writes the adapter's slot of sglang's
LoRA pool on every engine rank (planner/lora_cost.py, held to the pool sglang builds by
tests/test_lora_cost.py), padded to ``--max-lora-rank`` = the adapter's rank here. Dense models: the
seven dense targets; MoE models: attention (q, k, v, o; expert adapters are not built). Arithmetic
only: nothing is started.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

try:
    import p2pweights  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

from p2pweights.benchmarking.table import emit  # noqa: E402
from p2pweights.models import resolve_model  # noqa: E402
from p2pweights.models.checkpoint import trainer_tensors  # noqa: E402
from p2pweights.planner.lora_cost import lora_cost  # noqa: E402

MODELS = (("qwen3-0.6b", 1), ("qwen3-4b", 2), ("qwen3-30b-a3b", 4), ("qwen3-235b-a22b", 8))
COLUMNS = [("model", "model", ""), ("tp", "engine tp", "d"), ("rank", "adapter r", "d"), ("targets", "targets", ""),
           ("adapter_mb", "adapter update MB", ".2f"), ("merged_gb", "merged update GB", ".2f"),
           ("ratio", "adapter / merged", ".2e")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", default="16,64", help="adapter ranks (comma-separated)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    a = p.parse_args(argv)
    rows = []
    for name, tp in MODELS:
        path = resolve_model(name)
        cfg = json.load(open(os.path.join(path, "config.json")))
        merged = sum(s.nbytes for s in trainer_tensors(cfg).values())
        for r in (int(x) for x in a.ranks.split(",")):
            c = lora_cost(name, cfg, tp, r, merged)
            rows.append({"model": name, "tp": tp, "rank": r, "targets": "attention" if len(c.targets) == 4 else "dense",
                         "adapter_mb": c.adapter_bytes / 1e6, "merged_gb": c.merged_bytes / 1e9, "ratio": c.ratio})
    emit("one update to one engine: adapter vs merged", COLUMNS, rows, as_json=a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
