"""Delta records of one slot (p2pweights.deltas; layout in csrc/buffers/delta_codec.h): encode and
apply rates and the encoded size, against a plain memcpy of the slot measured in the same run.

    PYTHONPATH=python python3 benchmarks/bench_delta.py [--mib 64] [--units 2,4]
        [--fractions 0.001,0.01,0.03,0.1,0.5] [--threads 1] [--repeats 5] [--json] [--out FILE]

The slot holds BF16-like weights (normal floats cut to their top 16 bits). Each version differs from
the base in a fraction of the BF16 elements chosen uniformly at random, each moved by one ulp (the
lowest mantissa bit), as an RL step's small updates do; a unit of 4 compares element pairs. Rows per
(unit, changed fraction, threads), each the best of ``--repeats``:

- ``mode``, ``runs``, ``enc/full``: the record's mode and run count, and its bytes over the slot's;
- ``enc GB/s``: slot bytes encoded per second; ``enc/memcpy``: the encode's time over a memcpy of
  the slot (the cost of a host copy of what a full write moves); ``+base GB/s``: the encode that
  also sets base := cur (``update_base``; base restored between repeats, untimed);
- ``apply GB/s``: slot bytes per second of check + apply into a destination equal to the base;
  ``apply/memcpy`` as above;
- ``area GB/s``: the same as an engine rank's delta area does it: ``check``, then
  ``apply(checked=True)`` (one copying walk: deltas/area.py); ``chk+apply GB/s``: ``check``, then
  an ``apply`` that checks again (what an area did before ``checked``).

Every apply is compared with cur byte for byte, and every updated base too (``#wrong``: bytes that
differ). ``--json`` prints the rows as JSON instead of the table; ``--out`` also writes them to FILE.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from p2pweights import deltas
from p2pweights.benchmarking.table import emit, machine

COLUMNS = [
    ("unit", "unit", "d"),
    ("fraction", "changed", "g"),
    ("threads", "threads", "d"),
    ("mode", "mode", ""),
    ("runs", "runs", "d"),
    ("ratio", "enc/full", ".4f"),
    ("encode_gbps", "enc GB/s", ".2f"),
    ("encode_vs_memcpy", "enc/memcpy", ".2f"),
    ("update_gbps", "+base GB/s", ".2f"),
    ("apply_gbps", "apply GB/s", ".2f"),
    ("apply_vs_memcpy", "apply/memcpy", ".2f"),
    ("area_gbps", "area GB/s", ".2f"),
    ("check_apply_gbps", "chk+apply GB/s", ".2f"),
    ("wrong", "#wrong", "d"),
]


def best_of(repeats: int, run, before=None) -> float:
    """The shortest of ``repeats`` timed calls of run(), each after an untimed before()."""
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
    return best


def bf16_like(n_elements: int, rng: np.random.Generator) -> np.ndarray:
    weights = rng.standard_normal(n_elements, dtype=np.float32) * 0.02
    return (weights.view(np.uint32) >> 16).astype(np.uint16)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64, help="slot size in MiB")
    p.add_argument("--units", default="2,4")
    p.add_argument("--fractions", default="0.001,0.01,0.03,0.1,0.5", help="fractions of BF16 elements changed")
    p.add_argument("--threads", default="1", help="encode threads, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None, help="also write the rows as JSON to this file")
    a = p.parse_args()
    units = [int(u) for u in a.units.split(",")]
    fractions = [float(f) for f in a.fractions.split(",")]
    threads = [int(t) for t in a.threads.split(",")]
    nbytes = a.mib << 20
    rng = np.random.default_rng(a.seed)
    pristine = bf16_like(nbytes // 2, rng)
    base, dst = pristine.copy(), np.empty_like(pristine)
    out = np.empty(deltas.max_encoded(nbytes), dtype=np.uint8)
    out[:] = 0  # touched once: no page faults inside a timed encode
    memcpy_s = best_of(a.repeats, lambda: np.copyto(dst, pristine))
    rows = []
    for fraction in fractions:
        cur = pristine.copy()
        changed = rng.random(cur.size, dtype=np.float32) < fraction
        cur[changed] ^= 1
        for unit in units:
            for t in threads:
                def encode(update_base=False):
                    return deltas.encode(cur, base, unit, update_base=update_base, threads=t, out=out)

                def restore_base():
                    np.copyto(base, pristine)

                enc_s = best_of(a.repeats, encode, restore_base)
                upd_s = best_of(a.repeats, lambda: encode(True), restore_base)
                wrong = int(np.count_nonzero(base != cur)) * 2
                restore_base()
                rec = encode()
                apply_s = best_of(a.repeats, lambda: deltas.apply(rec, dst), lambda: np.copyto(dst, pristine))
                wrong += int(np.count_nonzero(dst != cur)) * 2

                def area_apply():
                    deltas.check(rec, dst.nbytes)
                    deltas.apply(rec, dst, checked=True)

                def check_then_apply():
                    deltas.check(rec, dst.nbytes)
                    deltas.apply(rec, dst)

                area_s = best_of(a.repeats, area_apply, lambda: np.copyto(dst, pristine))
                wrong += int(np.count_nonzero(dst != cur)) * 2
                twice_s = best_of(a.repeats, check_then_apply, lambda: np.copyto(dst, pristine))
                wrong += int(np.count_nonzero(dst != cur)) * 2
                rows.append({
                    "unit": unit, "fraction": fraction, "threads": t, "mode": rec.stats.mode, "runs": rec.stats.runs,
                    "ratio": rec.stats.ratio, "changed_bytes": rec.stats.changed_bytes,
                    "encoded_bytes": rec.stats.encoded_bytes,
                    "encode_gbps": nbytes / enc_s / 1e9, "encode_vs_memcpy": enc_s / memcpy_s,
                    "update_gbps": nbytes / upd_s / 1e9,
                    "apply_gbps": nbytes / apply_s / 1e9, "apply_vs_memcpy": apply_s / memcpy_s,
                    "area_gbps": nbytes / area_s / 1e9, "check_apply_gbps": nbytes / twice_s / 1e9, "wrong": wrong,
                })
    ok = not any(r["wrong"] for r in rows)
    memcpy_gbps = nbytes / memcpy_s / 1e9
    footer = (f"# memcpy of the slot: {memcpy_gbps:.2f} GB/s ({memcpy_s * 1e3:.2f} ms for {a.mib} MiB)\n"
              f"# {'OK' if ok else 'FAILED'}: every apply and every updated base equal to cur")
    extra = {"slot_bytes": nbytes, "memcpy_gbps": memcpy_gbps, "ok": ok, "machine": machine()}
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows, **extra}, f, indent=2)
    emit(f"delta records: {a.mib} MiB BF16-like slot, changes uniform over elements", COLUMNS, rows,
         as_json=a.json, footer=footer, extra=extra if a.json else None)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
