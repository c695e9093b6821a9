"""NIXL's two sender data paths on one GPU: native (NIXL's C API from the writer threads, no GIL)
vs Python (NIXL's Python API behind PyTransport), VRAM slots -> a VRAM receiver in its own process.

Per path and slot size, four rows:
  fill+write           an update of --size through 2 slots, each filled by a Python copy (as the
                       loaders do) then submitted; timed from the first fill to finish()
  fill+write +py loop  the same beside a Python thread spinning (a trainer's other Python); the
                       fill's own GIL waits count here, whatever the path
  write                size/slot-size slots filled beforehand, only the writes timed
  write +py loop       the same beside the spinning thread: the data path's own GIL cost
"py loop" = the spinner's turns per second meanwhile / idle. Every byte is checked. Prints a table,
then the rows as JSON.

    python benchmarks/gpu/bench_nixl_paths.py [--size 1GiB] [--slot-size 64MiB,4MiB] [--repeat 5]
    python benchmarks/gpu/bench_nixl_paths.py --device cpu --size 256MiB   # host memory (CPU test)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from p2pweights.benchmarking.python_loop import PythonLoop
from p2pweights.benchmarking.table import emit
from p2pweights.sender.buffers import TransferBuffers
from p2pweights.sender.writer import PipelinedWriter
from p2pweights.settings import format_size, parse_size
from p2pweights.transport.nixl_native import make_nixl_transport, path_of
from p2pweights.transport.publication import EnginePublication

HERE = os.path.dirname(os.path.abspath(__file__))
COLUMNS = [("path", "path", ""), ("device", "memory", ""), ("size", "size", ""), ("slots", "slots", ""),
           ("mode", "mode", ""), ("seconds", "seconds", ".4f"), ("gbps", "GB/s", ".2f"), ("py_loop", "py loop", ""),
           ("wrong_bytes", "#wrong", "d")]


class Peer:
    """The receiver: vram_peer.py (cuda) or p2pweights.transport.peer (cpu), one region."""

    def __init__(self, device: str, size: int):
        self.device = device
        if device == "cuda":
            self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "vram_peer.py"), "--transport", "nixl",
                                          "--size", str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.publication = EnginePublication.from_json(self.proc.stdout.readline())
        else:
            from p2pweights.transport.peer import PeerProcess

            self.host = PeerProcess("nixl", size, params=1, gap=0)
            self.publication = self.host.publication
        self.remote = min(t.data_ptr for t in self.publication.params.values())

    def pattern(self, size: int, seed: int) -> torch.Tensor:
        if self.device == "cuda":
            sys.path.insert(0, HERE)
            from vram_peer import pattern

            return pattern(size, seed)
        from p2pweights.transport.peer import pattern

        return torch.from_numpy(pattern(size, seed))

    def _ask(self, line: str) -> dict:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def check(self, seed: int) -> int:
        return self._ask(f"check {seed}")["wrong_bytes"] if self.device == "cuda" else self.host.check(seed)

    def zero(self) -> None:
        self._ask("zero") if self.device == "cuda" else self.host.zero()

    def close(self) -> None:
        if self.device == "cuda":
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        else:
            self.host.close()


def run_path(api: str, device: str, size: int, slot: int, repeat: int) -> list[dict]:
    peer = Peer(device, size)
    src = peer.pattern(size, 7)
    tr = make_nixl_transport(api=api)
    rows = []
    try:
        with TransferBuffers(slot, 2, device=device) as b:
            tr.register_memory(b.address, b.total_bytes, b.location)
            tr.connect(0, peer.publication.descriptor)
            w = PipelinedWriter(tr, b, transfer_timeout=60)
            w.add_engine(0, "nixl-peer", peer.publication.regions)
            slots = [b.slot_tensor(i) for i in range(2)]

            def update() -> float:
                t0 = time.perf_counter()
                for c in range(size // slot):
                    s = w.acquire()
                    slots[s].copy_(src[c * slot:(c + 1) * slot])
                    if device == "cuda":
                        torch.cuda.synchronize()
                    w.submit(s, [(0, slot, 0, peer.remote + c * slot)])
                w.finish()
                return time.perf_counter() - t0

            n = size // slot
            full = TransferBuffers(slot, n, device=device)
            tr.register_memory(full.address, full.total_bytes, full.location)
            for c in range(n):
                full.slot_tensor(c).copy_(src[c * slot:(c + 1) * slot])
            if device == "cuda":
                torch.cuda.synchronize()
            wfull = PipelinedWriter(tr, full, transfer_timeout=60)
            wfull.add_engine(0, "nixl-peer", peer.publication.regions)

            def writes() -> float:
                t0 = time.perf_counter()
                for _ in range(n):
                    s = wfull.acquire()
                    wfull.submit(s, [(0, slot, 0, peer.remote + s * slot)])
                wfull.finish()
                return time.perf_counter() - t0

            update()  # warm-up: connection, NIXL requests made (re-posted from then on)
            writes()
            for mode, run in (("fill+write", update), ("fill+write +py loop", update), ("write", writes),
                              ("write +py loop", writes)):
                times, loops, wrong = [], [], 0
                for _ in range(repeat):
                    peer.zero()
                    if not mode.endswith("py loop"):
                        times.append(run())
                    else:
                        idle = PythonLoop.idle_rate()
                        with PythonLoop() as loop:
                            times.append(run())
                        loops.append(loop.rate / idle)
                    wrong += peer.check(7)
                best = min(times)
                rows.append({"path": path_of(tr), "device": "VRAM" if device == "cuda" else "DRAM",
                             "bytes": size, "size": format_size(size), "slot_bytes": slot,
                             "slots": f"{size // slot} x {format_size(slot)}", "mode": mode, "seconds": best,
                             "gbps": size / best / 1e9, "median_seconds": sorted(times)[len(times) // 2],
                             "python_progress": sorted(loops)[len(loops) // 2] if loops else None,
                             "py_loop": f"{sorted(loops)[len(loops) // 2]:.2f}" if loops else "-",
                             "wrong_bytes": wrong})
            w.close()
            wfull.close()
            tr.disconnect(0)
            tr.deregister_memory(b.address)
            tr.deregister_memory(full.address)
            full.close()
    finally:
        tr.close()
        peer.close()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1GiB")
    p.add_argument("--slot-size", default="64MiB,4MiB", help="comma-separated: a row set for each")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = p.parse_args()
    size = parse_size(args.size)
    rows = [r for s in args.slot_size.split(",") for api in ("native", "python")
            for r in run_path(api, args.device, size, parse_size(s), args.repeat)]
    wrong = sum(r["wrong_bytes"] for r in rows)
    emit("NIXL sender data paths: native (C API, no GIL) vs Python", COLUMNS, rows, as_json=False,
         footer=f"# fastest of {args.repeat}; {'OK' if wrong == 0 else 'FAILED'} ({wrong} wrong bytes)")
    print(json.dumps(rows))
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
