"""Does Mooncake's Python API release the GIL while it moves bytes? A Python thread spins (counting
loop turns) while another thread runs one large blocking Mooncake write into a receiver process
(p2pweights.transport.peer, 127.0.0.1, TCP); then the same with the calls our backend makes
(transfer_submit_write + transfer_check_status polling). "loop" = the spinner's turns per second
during the call / idle; "blocked" = the share of that time the spinner slept waiting for the GIL
(from /proc/thread-self/schedstat: wall - on CPU - waiting for a CPU), which does not depend on how
busy the machine's cores are. A call that holds the GIL shows loop ~0 and blocked ~1 (the control
row: one C call that never lets the GIL go).

    python benchmarks/bench_mooncake_gil.py [--size 1GiB] [--repeat 3] [--json]
"""
from __future__ import annotations

import argparse
import threading
import time

from p2pweights.benchmarking.python_loop import PythonLoop
from p2pweights.benchmarking.table import emit
from p2pweights.sender.buffers import TransferBuffers
from p2pweights.settings import format_size, parse_size
from p2pweights.transport.mooncake import new_engine
from p2pweights.transport.peer import PeerProcess, pattern

COLUMNS = [("call", "call", ""), ("size", "size", ""), ("seconds", "seconds", ".3f"), ("gbps", "GB/s", ".3f"),
           ("loop", "loop", ".2f"), ("blocked", "blocked", ".2f"), ("wrong_bytes", "#wrong", "d")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1GiB")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    size = parse_size(args.size)
    peer = PeerProcess("mooncake", size, params=1, gap=0)
    engine, _ = new_engine()
    src = TransferBuffers(size, 1)
    src.slot_array(0)[:size] = pattern(size, 7)
    if engine.register_memory(src.address, src.total_bytes, "*") != 0:
        raise RuntimeError("Mooncake register_memory failed")
    remote = min(t.data_ptr for t in peer.publication.params.values())
    session = peer.publication.peer

    def sync_write() -> None:
        if engine.transfer_sync_write(session, src.address, remote, size) != 0:
            raise RuntimeError("transfer_sync_write failed")

    def submit_and_poll() -> None:  # what MooncakeBackend.post/poll call, from one writer thread
        bid = engine.transfer_submit_write(session, src.address, remote, size)
        while (rc := engine.transfer_check_status(bid)) == 0:
            time.sleep(0.0005)
        if rc != 1:
            raise RuntimeError(f"transfer_check_status returned {rc}")

    def holds_the_gil() -> None:  # the control: one C call that never lets the GIL go
        sum(range(60_000_000))

    rows = []
    try:
        for name, call in (("transfer_sync_write", sync_write), ("submit_write+check_status", submit_and_poll),
                           ("control: sum(range(6e7))", holds_the_gil)):
            best = None
            for _ in range(args.repeat):
                peer.zero()
                idle = PythonLoop.idle_rate()
                worker = threading.Thread(target=call)
                with PythonLoop() as loop:
                    t0 = time.perf_counter()
                    worker.start()
                    worker.join()
                    seconds = time.perf_counter() - t0
                run = {"call": name, "bytes": size, "size": format_size(size), "seconds": seconds,
                       "gbps": size / seconds / 1e9, "loop": loop.rate / idle, "blocked": loop.blocked,
                       "wrong_bytes": peer.check(7) if call is not holds_the_gil else 0}
                best = run if best is None or run["seconds"] < best["seconds"] else best
            rows.append(best)
    finally:
        engine.unregister_memory(src.address)
        src.close()
        peer.close()
    emit("Mooncake's Python calls and the GIL (a spinning Python thread beside one large write)", COLUMNS, rows,
         as_json=args.json, footer="# loop ~1 and blocked ~0: the call runs without the GIL")
    return 0 if all(r["wrong_bytes"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
