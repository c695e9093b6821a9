"""`p2pweights bench transport`: the same bytes through our pipelined writer and through the
vendor's own Python API alone, into a real receiver process, every byte checked.

ours:   a stand-in engine rank (p2pweights.transport.peer, its own process) registers ``--size``
        bytes; the native pipelined writer posts one batch per slot (Mooncake/NIXL behind
        PyTransport, deadlines, region checks). Two rows per size:
        "fill+write": the sender fills ``--slots`` slots of ``--slot-size`` from the pattern while
                      earlier slots are written (what an update does), timed from the first fill
                      to ``finish()`` returning;
        "write":      size/slot-size slots filled beforehand, only the writes timed (the pipeline's
                      own cost over the raw transport); then again beside a Python thread spinning
                      (a trainer's loaders): "GB/s +py loop", and "py loop" = the loop's turns per
                      second then / idle. A data path that takes the GIL slows one or the other.
        NIXL rows name the sender's data path: native (C API, no GIL) or python (--nixl-api).
vendor: the same bytes, already in one registered source buffer (no fill), in slot-size pieces,
        with the vendor API alone: Mooncake ``batch_transfer_sync_write`` (what sglang uses);
        NIXL one ``initialize_xfer`` + ``transfer`` + ``check_xfer_state`` loop (backing off).
The receiver memory is zeroed before each run and checked after it; runs alternate ours/vendor
and the fastest of ``--repeat`` counts. ratio = ours GB/s / vendor GB/s (target >= 0.95).
"""
from __future__ import annotations

import argparse
import time
from typing import Any

from ..sender.buffers import TransferBuffers
from ..sender.writer import PipelinedWriter
from ..settings import TRANSPORTS, format_size, parse_size, settings
from ..transport import attach_engine, make_sender_transport
from ..transport.peer import PeerProcess, pattern, push_pattern
from .python_loop import PythonLoop as _PythonLoop
from .table import emit

COLUMNS = [
    ("transport", "transport", ""),
    ("path", "path", ""),
    ("mode", "mode", ""),
    ("size", "size", ""),
    ("slots_desc", "slots", ""),
    ("seconds", "seconds", ".3f"),
    ("gbps", "GB/s", ".3f"),
    ("vendor_gbps", "vendor GB/s", ".3f"),
    ("ratio", "ratio", ".3f"),
    ("with_loop", "GB/s +py loop", ""),
    ("py_loop", "py loop", ""),
    ("wrong_bytes", "#wrong", "d"),
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", choices=TRANSPORTS, default=None, help="default: P2PW_TRANSPORT (auto)")
    p.add_argument("--size", default="256MiB", help="bytes per update; comma-separated for several rows (default: %(default)s)")
    p.add_argument("--slot-size", default="64MiB", help="transfer slot size (default: %(default)s)")
    p.add_argument("--slots", type=int, default=2, help="transfer slots (default: %(default)s)")
    p.add_argument("--params", type=int, default=16, help="parameters the receiver publishes (default: %(default)s)")
    p.add_argument("--repeat", type=int, default=5, help="runs of each; the fastest counts (default: %(default)s)")
    p.add_argument("--nixl-api", choices=("auto", "native", "python", "both"), default=None,
                   help="NIXL sender data path (default: P2PW_NIXL_API, auto); both: a row set for each")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")


class _Vendor:
    """The vendor's own API alone, writing a registered source buffer to the peer."""

    def __init__(self, transport: str, source: TransferBuffers, peer: PeerProcess, piece: int):
        self.transport = transport
        self.source = source
        pub = peer.publication
        self.remote = min(t.data_ptr for t in pub.params.values())
        self.region = pub.regions[0]
        self.piece = piece
        if transport == "mooncake":
            from ..transport.mooncake import new_engine

            self.engine, _ = new_engine()
            if self.engine.register_memory(source.address, source.total_bytes, "*") != 0:
                raise RuntimeError("Mooncake register_memory failed")
            self.session = pub.peer
        else:
            from ..transport.nixl import new_agent

            self.agent, _ = new_agent(f"p2pw-bench-vendor-{id(self):x}", settings().nixl_backend)
            self.reg = self.agent.register_memory([(source.address, source.total_bytes, 0, "")], "DRAM")
            self.peer_name = self.agent.add_remote_agent(pub.agent_metadata)

    def write(self, nbytes: int) -> float:
        if self.region[1] < nbytes:
            raise ValueError("the peer's first region is smaller than the size (use a contiguous layout)")
        offs = list(range(0, nbytes, self.piece))
        lens = [min(self.piece, nbytes - o) for o in offs]
        src = [self.source.address + o for o in offs]
        dst = [self.remote + o for o in offs]
        t0 = time.perf_counter()
        if self.transport == "mooncake":
            rc = self.engine.batch_transfer_sync_write(self.session, src, dst, lens)
            if rc != 0:
                raise RuntimeError(f"Mooncake batch_transfer_sync_write returned {rc}")
        else:
            a = self.agent
            h = a.initialize_xfer("WRITE", a.get_xfer_descs([(s, n, 0) for s, n in zip(src, lens)], "DRAM"),
                                  a.get_xfer_descs([(d, n, 0) for d, n in zip(dst, lens)], "DRAM"), self.peer_name)
            state = a.transfer(h)
            sleep = 20e-6
            while state == "PROC":
                time.sleep(sleep)
                sleep = min(sleep * 2, 2e-3)
                state = a.check_xfer_state(h)
            a.release_xfer_handle(h)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer ended {state}")
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.transport == "mooncake":
            self.engine.unregister_memory(self.source.address)
        else:
            self.agent.remove_remote_agent(self.peer_name)
            self.agent.deregister_memory(self.reg)


def _sender_transport(transport: str, nixl_api: str | None) -> tuple[Any, str]:
    if transport != "nixl":
        return make_sender_transport(transport), "python"
    from ..transport.nixl_native import make_nixl_transport, path_of

    t = make_nixl_transport(api=nixl_api, **settings(transport="nixl").transport_options())
    return t, path_of(t)


def run_one(transport: str, size: int, slot_bytes: int, num_slots: int, params: int, repeat: int,
            nixl_api: str | None = None) -> list[dict[str, Any]]:
    peer = PeerProcess(transport, size, params=params, gap=0)
    stream = pattern(size, 11)
    vstream = pattern(size, 12)
    sender, path = _sender_transport(transport, nixl_api)
    buffers = TransferBuffers(slot_bytes, num_slots)
    source = TransferBuffers(size, 1)
    vendor = writer = None
    try:
        sender.register_memory(buffers.address, buffers.total_bytes, buffers.location)
        writer = PipelinedWriter(sender, buffers, transfer_timeout=600)
        attach_engine(sender, writer, 0, "bench-engine", peer.publication)
        source.slot_array(0)[:size] = vstream
        vendor = _Vendor(transport, source, peer, buffers.slot_bytes)
        # "write" mode: as many slots as the size needs, filled once; only the writes are timed.
        n_full = -(-size // buffers.slot_bytes)
        full = TransferBuffers(buffers.slot_bytes, n_full)
        sender.register_memory(full.address, full.total_bytes, full.location)
        wfull = PipelinedWriter(sender, full, transfer_timeout=600)
        wfull.add_engine(0, "bench-engine", peer.publication.regions)
        base = min(t.data_ptr for t in peer.publication.params.values())
        for k in range(n_full):
            n = min(full.slot_bytes, size - k * full.slot_bytes)
            full.slot_array(k)[:n] = stream[k * full.slot_bytes:k * full.slot_bytes + n]

        def writes_only() -> None:
            for _ in range(n_full):
                slot = wfull.acquire()
                n = min(full.slot_bytes, size - slot * full.slot_bytes)
                wfull.submit(slot, [(0, n, 0, base + slot * full.slot_bytes)])
            assert wfull.finish().bytes == size

        times: dict[str, list[float]] = {"fill+write": [], "write": [], "write+loop": [], "vendor": []}
        progress: list[float] = []
        blocked: list[float] = []
        wrong = {"fill+write": 0, "write": 0}
        try:
            for _ in range(repeat):  # alternate, so the machine's noise hits all three alike
                peer.zero()
                t0 = time.perf_counter()
                report = push_pattern(writer, buffers, [(0, "bench-engine", peer.publication)], stream)
                times["fill+write"].append(time.perf_counter() - t0)
                assert report.bytes == size, (report.bytes, size)
                wrong["fill+write"] += peer.check(11)
                peer.zero()
                t0 = time.perf_counter()
                writes_only()
                times["write"].append(time.perf_counter() - t0)
                wrong["write"] += peer.check(11)
                peer.zero()
                # again beside a busy Python thread (a trainer's loaders): who waits for the GIL?
                idle = _PythonLoop.idle_rate()
                with _PythonLoop() as loop:
                    t0 = time.perf_counter()
                    writes_only()
                    times["write+loop"].append(time.perf_counter() - t0)
                progress.append(loop.rate / idle)
                blocked.append(loop.blocked)
                wrong["write"] += peer.check(11)
                peer.zero()
                times["vendor"].append(vendor.write(size))
                v = peer.check(12)
                wrong["fill+write"] += v
                wrong["write"] += v
        finally:
            wfull.close()
            sender.deregister_memory(full.address)
            full.close()
    finally:
        if vendor is not None:
            vendor.close()
        if writer is not None:
            writer.close()
        sender.close()
        buffers.close()
        source.close()
        peer.close()
    vbest = min(times["vendor"])
    rows = []
    for mode, slots_desc in (("fill+write", f"{num_slots} x {format_size(buffers.slot_bytes)}"),
                             ("write", f"{-(-size // buffers.slot_bytes)} x {format_size(buffers.slot_bytes)}")):
        best = min(times[mode])
        rows.append({
            "transport": transport,
            "path": path,
            "mode": mode,
            "bytes": size,
            "size": format_size(size),
            "slot_bytes": buffers.slot_bytes,
            "slots": num_slots if mode == "fill+write" else -(-size // buffers.slot_bytes),
            "slots_desc": slots_desc,
            "batches": -(-size // buffers.slot_bytes),
            "seconds": best,
            "gbps": size / best / 1e9,
            "vendor_seconds": vbest,
            "vendor_gbps": size / vbest / 1e9,
            "ratio": vbest / best,
            "median_seconds": sorted(times[mode])[len(times[mode]) // 2],
            "vendor_median_seconds": sorted(times["vendor"])[len(times["vendor"]) // 2],
            "repeat": repeat,
            # the Python loop's rate during the writes / idle (median of the runs; "write" mode only)
            "python_progress": sorted(progress)[len(progress) // 2] if mode == "write" else None,
            "python_blocked": sorted(blocked)[len(blocked) // 2] if mode == "write" else None,
            "gbps_with_python_loop": size / min(times["write+loop"]) / 1e9 if mode == "write" else None,
            "with_loop": f"{size / min(times['write+loop']) / 1e9:.3f}" if mode == "write" else "-",
            "py_loop": f"{sorted(progress)[len(progress) // 2]:.2f}" if mode == "write" else "-",
            "wrong_bytes": wrong[mode],
        })
    return rows


def run(args: argparse.Namespace) -> int:
    from ..transport import resolve_transport

    transport = resolve_transport(args.transport)[0]  # default P2PW_TRANSPORT; auto: nixl where its C API loads
    apis = ["native", "python"] if args.nixl_api == "both" and transport == "nixl" else [args.nixl_api]
    rows = [row for s in str(args.size).split(",") if s for api in apis
            for row in run_one(transport, parse_size(s), parse_size(args.slot_size), args.slots, args.params,
                               args.repeat, nixl_api=api if api != "both" else None)]
    wrong = sum(r["wrong_bytes"] for r in rows)
    avg = sum(r["ratio"] for r in rows) / len(rows)
    footer = (f"# avg ratio {avg:.3f} (target >= 0.95)   {'OK' if wrong == 0 else 'FAILED'} ({wrong} wrong bytes); "
              f"fastest of {args.repeat} runs each")
    emit(f"p2pweights bench transport ({transport}, receiver in its own process on 127.0.0.1)", COLUMNS, rows,
         as_json=args.json, footer=footer)
    return 0 if wrong == 0 else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="p2pweights bench transport", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    import sys

    sys.exit(main())
