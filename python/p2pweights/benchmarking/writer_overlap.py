"""`p2pweights bench writer`: fill alone, write alone and pipelined, over the loopback transport.

On a real link the NIC moves a slot's bytes while the CPU fills the next slot. On a 2-core machine
two memcpys would only fight for the memory bus, so the loopback transport emulates a link: a write
occupies it for bytes / bandwidth (default: the rate at which fill runs alone) and its bytes still
arrive and are checked. Overlap efficiency = max(fill, write) / pipelined; 1.0 is perfect overlap.
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from .. import _native
from ..sender.buffers import TransferBuffers
from ..sender.writer import PipelinedWriter
from ..settings import format_size, parse_size
from .table import emit

COLUMNS = [
    ("slot_size", "slot size", ""),
    ("slots", "slots", "d"),
    ("size", "bytes", ""),
    ("fill_seconds", "fill s", ".3f"),
    ("write_seconds", "write s", ".3f"),
    ("seconds", "pipelined s", ".3f"),
    ("gbps", "GB/s", ".2f"),
    ("overlap_efficiency", "overlap eff", ".3f"),
    ("wrong_bytes", "#wrong", "d"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slot-sizes", default="4MiB,16MiB,64MiB,256MiB", help="comma-separated slot sizes (default: %(default)s)")
    p.add_argument("--slots", type=int, default=2, help="transfer slots (default: %(default)s)")
    p.add_argument("--total", default="1GiB", help="bytes moved per slot size, at least 4 slots' worth (default: %(default)s)")
    p.add_argument("--link-gbps", type=float, default=None,
                   help="emulated link rate in GB/s (default: the measured rate of fill alone)")
    p.add_argument("--repeat", type=int, default=3, help="runs per measurement; the fastest counts (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")


def _fill(dst: np.ndarray, src: np.ndarray) -> None:
    np.copyto(dst[: src.nbytes], src)  # numpy releases the GIL for the copy


def run_one(slot_bytes: int, num_slots: int, total: int, link_gbps: float | None, repeat: int) -> dict:
    total = max(total, 4 * slot_bytes) // slot_bytes * slot_bytes
    chunks = total // slot_bytes
    rng = np.random.default_rng(slot_bytes)
    src = rng.integers(0, 256, size=total, dtype=np.uint8)
    dst = np.zeros(total, dtype=np.uint8)
    buffers = TransferBuffers(slot_bytes, num_slots, pin="auto")
    transport = _native.LoopbackTransport()
    transport.register_memory(buffers.address, buffers.total_bytes)
    transport.connect(0, "loopback")
    writer = PipelinedWriter(transport, buffers, transfer_timeout=600)
    writer.add_engine(0, "bench-engine", [(dst.ctypes.data, dst.nbytes)])
    views = [buffers.slot_array(i) for i in range(num_slots)]
    try:
        def fill_alone() -> float:
            t0 = time.perf_counter()
            for c in range(chunks):
                _fill(views[c % num_slots], src[c * slot_bytes:(c + 1) * slot_bytes])
            return time.perf_counter() - t0

        fill_s = min(fill_alone() for _ in range(repeat))
        link = link_gbps if link_gbps else total / fill_s / 1e9
        transport.set_fault(0, link_gbps=link)

        def write_alone() -> float:
            # Slots already hold bytes; only the writes run (what each slot holds does not matter here).
            t0 = time.perf_counter()
            for c in range(chunks):
                s = writer.acquire()
                writer.submit(s, [(0, slot_bytes, 0, dst.ctypes.data + c * slot_bytes)])
            writer.finish()
            return time.perf_counter() - t0

        write_s = min(write_alone() for _ in range(repeat))

        def pipelined() -> float:
            dst[:] = 0
            t0 = time.perf_counter()
            for c in range(chunks):
                s = writer.acquire()
                _fill(views[s], src[c * slot_bytes:(c + 1) * slot_bytes])
                writer.submit(s, [(0, slot_bytes, 0, dst.ctypes.data + c * slot_bytes)])
            report = writer.finish()
            assert report.bytes == total, (report.bytes, total)
            return time.perf_counter() - t0

        pipe_s = min(pipelined() for _ in range(repeat))
        wrong = int(np.count_nonzero(dst != src))
    finally:
        writer.close()
        transport.close()
        buffers.close()
    return {
        "slot_bytes": slot_bytes,
        "slot_size": format_size(slot_bytes),
        "slots": num_slots,
        "bytes": total,
        "size": format_size(total),
        "fill_seconds": fill_s,
        "write_seconds": write_s,
        "seconds": pipe_s,
        "gbps": total / pipe_s / 1e9,
        "link_gbps": link,
        "overlap_efficiency": max(fill_s, write_s) / pipe_s,
        "wrong_bytes": wrong,
    }


def run(args: argparse.Namespace) -> int:
    sizes = [parse_size(s) for s in args.slot_sizes.split(",") if s]
    rows = [run_one(s, args.slots, parse_size(args.total), args.link_gbps, args.repeat) for s in sizes]
    wrong = sum(r["wrong_bytes"] for r in rows)
    avg = sum(r["overlap_efficiency"] for r in rows) / len(rows)
    footer = f"# avg overlap efficiency {avg:.3f}   {'OK' if wrong == 0 else 'FAILED'} ({wrong} wrong bytes)"
    emit("p2pweights bench writer (loopback transport, emulated link)", COLUMNS, rows, as_json=args.json, footer=footer)
    return 0 if wrong == 0 else 1
