"""`p2pweights plan` (not built yet)."""
from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise SystemExit("p2pweights plan: not implemented yet")
