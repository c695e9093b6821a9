"""Mooncake's TCP transport over loopback: what bounds a sender's write rate, and which knobs help.

A sender process writes ``--size`` bytes into each of ``--peers`` receiver processes
(p2pweights.transport.peer, real Mooncake TransferEngines on 127.0.0.1), the way MooncakeBackend
does: each write split into ``pieces`` (``transfer_submit_write``, a Mooncake batch of one each),
polled with ``transfer_check_status`` and a backoff. Every configuration runs in its own process
(Mooncake reads its MC_* variables once, in each process: the receivers get the same environment),
configurations are interleaved over ``--rounds`` so they see the same machine, and every byte is
checked at the receivers. Columns: GB/s (all peers' bytes / wall time, median over rounds), the
sender's CPU seconds per GB (its process: Python + Mooncake's io thread) and the receivers'.

    python benchmarks/bench_mooncake_tcp.py [--size 256MiB] [--peers 2] [--rounds 3] [--json]

Mooncake 0.3.13 (mooncake-transfer-engine/src/transport/tcp_transport/): one asio io thread per
TransferEngine runs every socket of that process; each request is one slice on one of
MC_TCP_LANES_PER_PEER (default 4) persistent connections per peer; the body moves in
MC_TCP_SLICE_SIZE chunks (default 64 KiB: one async_write / async_read and one handler per chunk on
each side); protocol v2 acknowledges a WRITE once the receiver has applied it.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MIB = 1 << 20
CONFIGS: list[tuple[str, dict[str, str], int, str]] = [
    # (name, environment, pieces per write, poll: "all" pending pieces each round | "ordered": up to
    # the first one still running)
    ("1 piece, defaults (64 KiB chunks, 4 lanes)", {}, 1, "all"),
    ("4 pieces", {}, 4, "all"),
    ("1 piece, MC_TCP_SLICE_SIZE=1MiB", {"MC_TCP_SLICE_SIZE": str(MIB)}, 1, "all"),
    ("1 piece, MC_TCP_SLICE_SIZE=4MiB", {"MC_TCP_SLICE_SIZE": str(4 * MIB)}, 1, "all"),
    ("1 piece, MC_TCP_SLICE_SIZE=16MiB", {"MC_TCP_SLICE_SIZE": str(16 * MIB)}, 1, "all"),
    ("1 piece, MC_TCP_LANES_PER_PEER=1", {"MC_TCP_LANES_PER_PEER": "1"}, 1, "all"),
    # the demo's shape: ~2 MiB per parameter, no two contiguous on both sides, so one request each
    ("128 pieces, poll all", {}, 128, "all"),
    ("128 pieces, poll ordered", {}, 128, "ordered"),
    ("128 pieces, poll ordered, 16 lanes", {"MC_TCP_LANES_PER_PEER": "16"}, 128, "ordered"),
    ("128 pieces, poll ordered, 1 lane", {"MC_TCP_LANES_PER_PEER": "1"}, 128, "ordered"),
    ("128 pieces, poll ordered, MC_TCP_SLICE_SIZE=1MiB", {"MC_TCP_SLICE_SIZE": str(MIB)}, 128, "ordered"),
    ("128 pieces, poll ordered, MC_TCP_SLICE_SIZE=4MiB", {"MC_TCP_SLICE_SIZE": str(4 * MIB)}, 128, "ordered"),
    ("128 pieces, poll all, 16 lanes", {"MC_TCP_LANES_PER_PEER": "16"}, 128, "all"),
    ("128 pieces, poll ordered, 8 lanes", {"MC_TCP_LANES_PER_PEER": "8"}, 128, "ordered"),
    ("128 pieces, poll ordered, 32 lanes", {"MC_TCP_LANES_PER_PEER": "32"}, 128, "ordered"),
]


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def child(size: int, peers: int, pieces: int, repeat: int, poll: str) -> dict:
    from p2pweights.sender.buffers import TransferBuffers
    from p2pweights.transport.mooncake import new_engine
    from p2pweights.transport.peer import PeerProcess, pattern

    procs = [PeerProcess("mooncake", size, params=1, gap=0) for _ in range(peers)]
    engine, _ = new_engine()
    src = TransferBuffers(size, 1)
    src.slot_array(0)[:size] = pattern(size, 7)
    if engine.register_memory(src.address, src.total_bytes, "*") != 0:
        raise RuntimeError("Mooncake register_memory failed")
    targets = [(p.publication.peer, min(t.data_ptr for t in p.publication.params.values())) for p in procs]
    for session, _ in targets:
        engine.get_first_buffer_address(session)  # the handshake, outside the clock
    each = -(-size // pieces)
    runs = []
    try:
        for _ in range(repeat):
            for p in procs:
                p.zero()
            cpu0, peer0, t0 = time.process_time(), [_proc_cpu(p.pid) for p in procs], time.perf_counter()
            pending = []
            for session, remote in targets:
                for off in range(0, size, each):
                    n = min(each, size - off)
                    bid = engine.transfer_submit_write(session, src.address + off, remote + off, n)
                    if bid < 0:
                        raise RuntimeError("transfer_submit_write failed")
                    pending.append(bid)
            sleep = 20e-6
            while pending:  # the native writer's poll: backoff 20 us .. 2 ms
                still = []
                for i, bid in enumerate(pending):
                    rc = engine.transfer_check_status(bid)
                    if rc == 0:
                        still.append(bid)
                        if poll == "ordered":  # the rest were submitted later: asked next round
                            still += pending[i + 1:]
                            break
                    elif rc != 1:
                        raise RuntimeError(f"transfer_check_status returned {rc}")
                sleep = 20e-6 if len(still) < len(pending) else min(sleep * 2, 2e-3)
                pending = still
                if pending:
                    time.sleep(sleep)
            seconds = time.perf_counter() - t0
            sender_cpu = time.process_time() - cpu0
            peer_cpu = sum(_proc_cpu(p.pid) for p in procs) - sum(peer0)
            wrong = sum(p.check(7) for p in procs)
            runs.append({"seconds": seconds, "sender_cpu": sender_cpu, "peer_cpu": peer_cpu, "wrong": wrong})
    finally:
        engine.unregister_memory(src.address)
        src.close()
        for p in procs:
            p.close()
    best = min(runs, key=lambda r: r["seconds"])
    return {**best, "wrong": sum(r["wrong"] for r in runs)}


def _run_child(name: str, size: int, args: argparse.Namespace, env: dict[str, str], pieces: int, poll: str) -> dict:
    """One configuration in its own process; asked twice before giving up (a peer process that did
    not start in time on a busy machine)."""
    cmd = [sys.executable, __file__, "--size", str(size), "--peers", str(args.peers), "--repeat", str(args.repeat),
           "--child", json.dumps({"pieces": pieces, "poll": poll})]
    for _attempt in range(2):
        # Mooncake's own default of 4 lanes unless the row says otherwise (p2pweights' new_engine,
        # which the child calls, would set 16)
        out = subprocess.run(cmd, env={**os.environ, "GLOG_minloglevel": "2", "MC_TCP_LANES_PER_PEER": "4", **env},
                             capture_output=True, text=True, timeout=600)
        if out.returncode == 0:
            return json.loads(out.stdout.strip().splitlines()[-1])
    raise RuntimeError(f"{name}: exit code {out.returncode}: {out.stderr[-3000:]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="256MiB", help="bytes per peer (default: %(default)s)")
    p.add_argument("--peers", type=int, default=2, help="receiver processes written at once (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds over the configurations")
    p.add_argument("--repeat", type=int, default=2, help="writes per configuration per round (best kept)")
    p.add_argument("--only", default=None, help="comma-separated config indexes")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    from p2pweights.benchmarking.table import emit
    from p2pweights.settings import format_size, parse_size

    size = parse_size(args.size)
    if args.child:
        c = json.loads(args.child)
        print(json.dumps(child(size, args.peers, c["pieces"], args.repeat, c["poll"])))
        return 0
    configs = [c for i, c in enumerate(CONFIGS) if args.only is None or str(i) in args.only.split(",")]
    runs: dict[str, list[dict]] = {name: [] for name, _, _, _ in configs}
    for _ in range(args.rounds):
        for name, env, pieces, poll in configs:
            runs[name].append(_run_child(name, size, args, env, pieces, poll))
    total = size * args.peers
    rows = []
    for name, env, pieces, poll in configs:
        rs = runs[name]
        sec = statistics.median(r["seconds"] for r in rs)
        rows.append({"config": name, "env": env, "pieces": pieces, "poll": poll, "bytes": total, "seconds": sec,
                     "gbps": total / sec / 1e9,
                     "sender_cpu_per_gb": statistics.median(r["sender_cpu"] for r in rs) / (total / 1e9),
                     "peer_cpu_per_gb": statistics.median(r["peer_cpu"] for r in rs) / (total / 1e9),
                     "wrong_bytes": sum(r["wrong"] for r in rs)})
    base = rows[0]["gbps"]
    for r in rows:
        r["vs_first"] = r["gbps"] / base
    cols = [("config", "config", ""), ("seconds", "seconds", ".3f"), ("gbps", "GB/s", ".2f"),
            ("vs_first", "x first row", ".2f"), ("sender_cpu_per_gb", "sender CPU s/GB", ".2f"),
            ("peer_cpu_per_gb", "receivers CPU s/GB", ".2f"), ("wrong_bytes", "#wrong", "d")]
    emit(f"Mooncake TCP over loopback: {args.peers} peer(s) x {format_size(size)}, median of {args.rounds} "
         f"interleaved rounds", cols, rows, as_json=args.json)
    return 0 if all(r["wrong_bytes"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
