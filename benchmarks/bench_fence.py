"""The cost of the writer's fence (docs/security.md, "Fencing"): small batches through the loopback
transport, fenced (a far deadline, checked on the write thread before every post) vs unfenced,
alternating in one run, best of ``--rounds``; every batch's bytes checked.

    python3 benchmarks/bench_fence.py [--batches 2000] [--rounds 7] [--json]
"""
from __future__ import annotations

import argparse
import math
import sys
import time

import numpy as np

from p2pweights import _native
from p2pweights.benchmarking.table import emit
from p2pweights.sender.buffers import TransferBuffers
from p2pweights.sender.writer import PipelinedWriter

SLOT = 2 << 20
BATCH = 4096
COLUMNS = [("mode", "mode", ""), ("batches", "batches", "d"), ("us", "us per batch", ".2f"), ("wrong", "#wrong", "d")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    buffers = TransferBuffers(SLOT, 2, pin="none")
    transport = _native.LoopbackTransport()
    transport.register_memory(buffers.address, buffers.total_bytes)
    writer = PipelinedWriter(transport, buffers, transfer_timeout=30)
    region = np.zeros(4 << 20, np.uint8)
    transport.connect(0, "loopback")
    writer.add_engine(0, "engine-0", [(region.ctypes.data, region.nbytes)])
    best = {"unfenced": math.inf, "fenced": math.inf}
    wrong = {"unfenced": 0, "fenced": 0}
    try:
        for r in range(a.rounds):
            for mode, seconds in (("unfenced", math.inf), ("fenced", 3600.0)):
                writer.fence(0, seconds)
                value = (2 * r + (mode == "fenced")) % 251 + 1
                for i in range(2):
                    buffers.slot_array(i)[:BATCH] = value
                t0 = time.perf_counter()
                for _ in range(a.batches):
                    writer.submit(writer.acquire(), [(0, BATCH, 0, region.ctypes.data)])
                writer.finish()
                best[mode] = min(best[mode], (time.perf_counter() - t0) / a.batches)
                wrong[mode] += int((region[:BATCH] != value).sum())
    finally:
        writer.close()
        transport.close()
        buffers.close()
    rows = [{"mode": m, "batches": a.batches, "us": best[m] * 1e6, "wrong": wrong[m]} for m in best]
    ok = not any(wrong.values())
    footer = (f"# fenced/unfenced {best['fenced'] / best['unfenced']:.3f}\n"
              f"# {'OK' if ok else 'FAILED'}: every batch's bytes landed")
    emit("the writer's fence: per-batch cost (loopback, 4 KiB batches)", COLUMNS, rows, as_json=a.json, footer=footer,
         extra={"ratio": best["fenced"] / best["unfenced"], "ok": ok} if a.json else None)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
