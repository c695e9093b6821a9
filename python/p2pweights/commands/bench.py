"""`p2pweights bench KIND`: benchmarks that print one table format (and JSON) and check their bytes."""
from __future__ import annotations

import argparse
import importlib

# kind -> (module under p2pweights.benchmarking, help)
KINDS = {
    "writer": ("writer_overlap", "the pipelined writer over the loopback transport: fill, write, overlap"),
    "transport": ("transport_vs_vendor", "our pipelined writer vs the vendor's own API over Mooncake or NIXL"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="kind", metavar="KIND", required=True)
    for kind, (module, help_text) in KINDS.items():
        p = sub.add_parser(kind, help=help_text, description=help_text)
        try:
            mod = importlib.import_module(f"p2pweights.benchmarking.{module}")
        except ImportError as e:  # a benchmark whose optional dependency is missing still lists
            p.set_defaults(_bench=None, _why=str(e))
            continue
        mod.add_arguments(p)
        p.set_defaults(_bench=mod.run)


def run(args: argparse.Namespace) -> int:
    if args._bench is None:
        raise SystemExit(f"p2pweights bench {args.kind}: unavailable ({args._why})")
    return int(args._bench(args) or 0)
