"""Where a steady delta update's time goes on a CPU host: one sender, one receiver engine, host slots.

    PYTHONPATH=python python3 benchmarks/profile_delta_cpu.py [--model qwen3-0.6b] [--engine tp=2] \\
        [--fraction 0.01] [--updates 4] [--transport nixl] [--profile]
    P2PW_COPY_THREADS=1 PYTHONPATH=python python3 benchmarks/profile_delta_cpu.py   # the compare on one thread

Version 0 is the first (full) update; versions 1..``--updates`` change ``--fraction`` of the elements
each (deltas). Per update: the report's seconds and phases, bytes written, and the engine's check
(byte for byte, ``check_weights_equal``). ``--profile``: cProfile of the last update, top 25 by
cumulative time (the native compare is ``_native.delta_encode``, the slot copies
``_native.run_copy_program_host``, the engine's apply inside the ``end_weight_update`` round trip).
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

try:
    import p2pweights  # noqa: F401  (an installed wheel)
except ImportError:  # from a checkout: the package from source
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

from p2pweights.control import SglangEngine  # noqa: E402
from p2pweights.models import resolve_model  # noqa: E402
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint  # noqa: E402
from p2pweights.receiver import check_weights_equal, start_engines  # noqa: E402
from p2pweights.sender import WeightSender  # noqa: E402

PHASES = ("seconds", "staging_seconds", "loading_seconds", "writing_seconds", "control_seconds")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--engine", default="tp=2")
    p.add_argument("--fraction", type=float, default=0.01)
    p.add_argument("--updates", type=int, default=4, help="delta updates after the first (full) one")
    p.add_argument("--transport", default="nixl", choices=("nixl", "mooncake"))
    p.add_argument("--profile", action="store_true", help="cProfile the last update")
    a = p.parse_args(argv)
    cfg = resolve_model(a.model)
    (engine,) = start_engines(cfg, a.engine, count=1, transport=a.transport)
    ok = True
    try:
        sender = WeightSender(cfg, transport=a.transport)
        sender.connect([SglangEngine(engine.url, name=engine.name)])
        if sender.recorder is not None:
            sender.recorder.wait(600)
        specs = checkpoint_tensors(cfg)
        print(f"{'version':>7}  " + "  ".join(f"{k:>16}" for k in PHASES) + f"  {'written MB':>10}  equal")
        prof = None
        for step in range(a.updates + 1):
            tensors = list(random_checkpoint(specs, 7, changed=(a.fraction, step)))
            if a.profile and step == a.updates:
                prof = cProfile.Profile()
                prof.enable()
            t0 = time.perf_counter()
            with sender.update(step) as u:
                u.push_many(tensors)
            wall = time.perf_counter() - t0
            if prof is not None:
                prof.disable()
            d = u.report.to_dict()
            equal = check_weights_equal(engine.url, hf_seed=7, changed_fraction=a.fraction, changed_steps=step)["success"]
            ok &= bool(equal)
            print(f"{step:>7}  " + "  ".join(f"{d[k]:>16.3f}" for k in PHASES)
                  + f"  {d['bytes_written'] / 1e6:>10.1f}  {equal}  (wall {wall:.3f} s)")
        sender.close()
        if prof is not None:
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    finally:
        engine.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
