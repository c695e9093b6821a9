"""An engine rank's delta apply at scale (issue 36, item 5): ``DeltaArea.apply`` of 1%-changed BF16
index records (FP8's 1-byte ones with ``--units 1``) over 4 to 32 GiB of a rank's weights on one
GPU, one writer and two (PP stages: two segments), best of ``--repeats`` after the first run. The
planner's ``--apply-gbps`` is the ``covered GB/s`` column: weight bytes the records cover per
second of check and apply.

    python3 benchmarks/gpu/bench_apply_scale.py --gib 4,16,32 --writers 1,2 --out apply_scale.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    import torch
    from bench_gpu_delta import engine_apply_rows

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", default="4,16,32", help="weight sizes of the rank, GiB (comma list)")
    parser.add_argument("--writers", default="1,2", help="writers of the rank's area (comma list)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--units", default="2", help="element sizes (comma list): 2 = BF16, 1 = FP8")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rows = []
    print(f"{'unit':>4} {'GiB':>4} {'writers':>7} {'records':>7} {'best s':>8} {'check s':>8} {'apply s':>8} {'reads':>5} "
          f"{'covered GB/s':>12} {'first s':>8} equal")
    for unit, gib in ((u, g) for u in map(int, args.units.split(",")) for g in map(int, args.gib.split(","))):
        free = torch.cuda.mem_get_info()[0]
        if 3.2 * (gib << 30) > free:  # the weights, the new ones and the base while the records are made
            print(f"{unit:>4} {gib:>4} skipped: needs about {3.2 * gib:.0f} GiB, {free / 2**30:.0f} GiB free on this GPU")
            continue
        for writers in (int(x) for x in args.writers.split(",")):
            got = engine_apply_rows(gib << 30, writers=writers, repeats=args.repeats, unit=unit)
            torch.cuda.empty_cache()
            best = min(got[1:], key=lambda r: r["seconds"])
            rows += got
            print(f"{unit:>4} {gib:>4} {writers:>7} {best['records']:>7} {best['seconds']:>8.4f} {best['check_s']:>8.4f} "
                  f"{best['apply_s']:>8.4f} {best['device_reads']:>5} {best['covered_gbps']:>12.0f} "
                  f"{got[0]['seconds']:>8.4f} {all(r['equal'] for r in got)}", flush=True)
    doc = {"device": torch.cuda.get_device_name(), "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all(r["equal"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
