"""The `p2pweights` command line. Each verb lives in its own module under p2pweights/commands/."""
from __future__ import annotations

import argparse
import importlib
import sys

from .errors import P2PWeightsError

# verb -> module under p2pweights.commands exposing add_arguments(parser) and run(args) -> int
VERBS = {
    "doctor": ("doctor", "check the native module, pinning, CUDA, transports and sglang"),
    "plan": ("plan", "who sends what to which engine rank, and predicted seconds (P2P vs broadcast)"),
    "check-layout": ("check_layout", "prove the replica path produces sglang's exact bytes for a model and engine flags"),
    "demo": ("demo", "start engines and senders on this machine and run updates (P2P and broadcast)"),
    "bench": ("bench", "benchmarks: writer, transport, ..."),
    "serve": ("serve", "run one receiver engine (all its ranks) in the foreground, serving sglang's routes"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="p2pweights", description=__doc__)
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for verb, (module, help_text) in VERBS.items():
        p = sub.add_parser(verb, help=help_text, description=help_text)
        mod = importlib.import_module(f"p2pweights.commands.{module}")
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "verb", None):
        parser.print_help()
        return 2

    try:
        return int(args._run(args) or 0)
    except P2PWeightsError as e:
        # a refusal the user can act on (unknown model, bad layout key, invalid setting): the
        # message names the fix, a traceback would only hide it
        print(f"p2pweights {args.verb}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
