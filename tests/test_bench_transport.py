"""pytest-benchmark: the pipelined writer over Mooncake and NIXL into a receiver process (small
sizes), every byte checked; and `p2pweights bench transport --json` end to end."""
from __future__ import annotations

import argparse
import io
import json
from contextlib import redirect_stdout

import pytest

from p2pweights.benchmarking import transport_vs_vendor as bench
from p2pweights.sender.buffers import TransferBuffers
from p2pweights.sender.writer import PipelinedWriter
from p2pweights.transport import attach_engine, make_sender_transport
from p2pweights.transport.peer import PeerProcess, pattern, push_pattern

MiB = 1 << 20


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_bench_pipelined_writer(benchmark, backend):
    size, slot = 32 * MiB, 8 * MiB
    peer = PeerProcess(backend, size, params=8)
    transport = make_sender_transport(backend)
    buffers = TransferBuffers(slot, 2)
    transport.register_memory(buffers.address, buffers.total_bytes, buffers.location)
    writer = PipelinedWriter(transport, buffers, transfer_timeout=30)
    try:
        attach_engine(transport, writer, 0, "bench-engine", peer.publication)
        stream = pattern(size, 21)
        target = [(0, "bench-engine", peer.publication)]
        report = benchmark.pedantic(push_pattern, args=(writer, buffers, target, stream), rounds=5, iterations=1,
                                    warmup_rounds=1)
        assert report.ok and report.bytes == size
        assert peer.check(21) == 0
        benchmark.extra_info["bytes"] = size
        if benchmark.stats:  # None under --benchmark-disable
            benchmark.extra_info["gbps"] = size / benchmark.stats.stats.min / 1e9
    finally:
        writer.close()
        transport.close()
        buffers.close()
        peer.close()


@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_bench_transport_command_reports_rows_as_json(backend):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--transport", backend, "--size", "16MiB", "--slot-size", "4MiB", "--repeat", "2", "--json"])
    out = io.StringIO()
    with redirect_stdout(out):
        rc = bench.run(args)
    rows = json.loads(out.getvalue())
    assert rc == 0
    assert {r["mode"] for r in rows} == {"fill+write", "write"}
    for r in rows:
        assert {"transport", "bytes", "gbps", "vendor_gbps", "wrong_bytes"} <= set(r)
        assert r["transport"] == backend and r["bytes"] == 16 * MiB and r["wrong_bytes"] == 0
        assert r["gbps"] > 0 and r["vendor_gbps"] > 0
