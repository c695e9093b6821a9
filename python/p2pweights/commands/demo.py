"""`p2pweights demo`: the main job. Until the end-to-end path lands, it runs the writer benchmark."""
from __future__ import annotations

import argparse

from ..bench import writer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    writer.add_arguments(parser)
    parser.set_defaults(slot_sizes="16MiB,64MiB", total="256MiB", repeat=2)


def run(args: argparse.Namespace) -> int:
    return writer.run(args)
