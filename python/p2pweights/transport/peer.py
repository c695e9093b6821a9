"""A stand-in engine rank for transport tests and benchmarks, run as its own process.

``python -m p2pweights.transport.peer --transport mooncake --size 256MiB --params 16`` registers one
host region holding ``--params`` equal parameters (``--gap`` bytes apart, gaps unpublished),
prints its publication as one JSON line on stdout, then answers line commands on stdin:

  {"cmd": "check", "seed": S}   -> {"wrong_bytes": n, "bytes": N}  (every parameter byte against the
                                   pattern of seed S, plus every gap byte against 0)
  {"cmd": "nonzero"}            -> {"nonzero_bytes": n}  (the whole region, gaps included)
  {"cmd": "zero"}               -> {"ok": true}
  {"cmd": "revoke"}             -> {"publication": {...}}  (the next epoch: a new endpoint for the same
                                   region, the old one closed, as an engine does at a takeover)
  {"cmd": "exit"}               -> exits

:class:`PeerProcess` drives it from the sender side; :func:`pattern` and :func:`push_pattern` are
the sender's half (fill slots from the pattern stream, one batch per slot per engine).
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import select
import signal
import subprocess
import sys
from typing import Any, Sequence

import numpy as np

from ..settings import parse_size
from .publication import EnginePublication
from .revocation import RevocableRegions

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def pattern(nbytes: int, seed: int, offset: int = 0) -> np.ndarray:
    """Bytes [offset, offset + nbytes) of the pattern stream for ``seed`` (offset, nbytes multiples of 8)."""
    words = np.arange(offset // 8, (offset + nbytes) // 8, dtype=np.uint64)
    words *= _GOLDEN
    words ^= np.uint64((seed * 0x2545F4914F6CDD1D + 1) & ((1 << 64) - 1))
    return words.view(np.uint8)


def layout(size: int, params: int, gap: int) -> list[tuple[str, int, int]]:
    """(name, region offset, nbytes) of each parameter."""
    each = size // params
    if each % 8 or each <= 0:
        raise ValueError("size / params must be a positive multiple of 8")
    return [(f"model.layers.{i}.weight", i * (each + gap), each) for i in range(params)]


# -- the receiver process ------------------------------------------------------------------------
def _serve(args: argparse.Namespace) -> int:
    # The protocol owns the real stdout; whatever the libraries print goes to stderr.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    size = parse_size(args.size)
    params = layout(size, args.params, args.gap)
    total = params[-1][1] + params[-1][2]
    region = mmap.mmap(-1, total, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf = np.frombuffer(region, dtype=np.uint8)
    buf[:] = 0
    base = buf.ctypes.data
    table = {name: [base + off, n // 2, 2] for name, off, n in params}  # 2-byte elements, like bf16
    regions = RevocableRegions(args.transport, [(base, total, "cpu")], table, args.rank)
    pub = regions.publication
    print(json.dumps({"publication": pub.to_dict(), "pid": os.getpid()}), file=out, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "check":
            wrong, stream_off = 0, 0
            expect_end = 0
            for _, off, n in params:
                wrong += int(np.count_nonzero(buf[expect_end:off]))  # gap before this parameter
                got = buf[off:off + n]
                wrong += int(np.count_nonzero(got != pattern(n, int(cmd["seed"]), stream_off)))
                stream_off += n
                expect_end = off + n
            print(json.dumps({"wrong_bytes": wrong, "bytes": stream_off}), file=out, flush=True)
        elif cmd["cmd"] == "nonzero":
            print(json.dumps({"nonzero_bytes": int(np.count_nonzero(buf))}), file=out, flush=True)
        elif cmd["cmd"] == "zero":
            buf[:] = 0
            print(json.dumps({"ok": True}), file=out, flush=True)
        elif cmd["cmd"] == "revoke":
            pub = regions.revoke(regions.epoch + 1)
            print(json.dumps({"publication": pub.to_dict()}), file=out, flush=True)
        elif cmd["cmd"] == "exit":
            break
    regions.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--transport", required=True, choices=("mooncake", "nixl"))
    p.add_argument("--size", default="256MiB")
    p.add_argument("--params", type=int, default=16)
    p.add_argument("--gap", type=int, default=0, help="unpublished bytes between parameters")
    p.add_argument("--rank", type=int, default=0)
    return _serve(p.parse_args(argv))


def wait_stopped(pid: int, timeout: float = 20.0) -> None:
    """Wait until process ``pid`` is stopped (SIGSTOP: state ``T``); TimeoutError otherwise."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.01)
    raise TimeoutError(f"process {pid} did not stop within {timeout:g} s")


# -- the sender's side ---------------------------------------------------------------------------
class PeerProcess:
    """A running peer: its publication, byte checks, and the faults tests inject (kill, stop)."""

    def __init__(self, transport: str, size: str | int = "256MiB", params: int = 16, gap: int = 0, rank: int = 0,
                 env: dict[str, str] | None = None, start_timeout: float = 30.0):
        cmd = [sys.executable, "-m", "p2pweights.transport.peer", "--transport", transport, "--size", str(size),
               "--params", str(params), "--gap", str(gap), "--rank", str(rank)]
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=full_env)
        hello = self._read(start_timeout)

        self.publication = EnginePublication.from_json(hello["publication"])
        self.publication_json = json.dumps(hello["publication"])
        self.pid = int(hello["pid"])

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"peer {self.proc.pid} did not answer within {timeout} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer {self.proc.pid} exited (code {self.proc.poll()})")
        return json.loads(line)

    def _ask(self, cmd: dict[str, Any], timeout: float = 60.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def check(self, seed: int) -> int:
        """Wrong bytes in the peer's memory for the pattern of ``seed`` (0 = every byte right)."""
        return int(self._ask({"cmd": "check", "seed": seed})["wrong_bytes"])

    def nonzero(self) -> int:
        """Bytes of the whole region (gaps included) that are not zero."""
        return int(self._ask({"cmd": "nonzero"})["nonzero_bytes"])

    def zero(self) -> None:
        self._ask({"cmd": "zero"})

    def revoke(self) -> None:
        """The peer moves to its next epoch: a new endpoint for the same memory (a new publication),
        the old one closed (transport/revocation.py)."""
        hello = self._ask({"cmd": "revoke"})
        self.publication = EnginePublication.from_json(hello["publication"])
        self.publication_json = json.dumps(hello["publication"])

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def cont(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.cont()
            try:
                self._ask({"cmd": "exit"}, timeout=10)
            except Exception:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            if f:
                try:
                    f.close()
                except Exception:
                    pass


def push_pattern(writer: Any, buffers: Any, targets: Sequence[tuple[int, str, Any]], stream: np.ndarray,
                 params: Sequence[tuple[str, int]] | None = None, finish: bool = True,
                 on_submit: Any = None):
    """Write ``stream`` (the parameters' bytes, in data_ptr order) to every target through the writer.

    targets: (engine id, engine name, EnginePublication). params: the sender's (name, nbytes) per
    parameter, in stream order (default: the first target's table). Every parameter's byte count is
    checked against every target before anything is posted (LayoutMismatch). One batch per slot per
    engine. ``on_submit(k)`` is called after the k-th slot was submitted (tests inject faults
    there). Returns the writer's report when ``finish``.
    """
    if params is None:
        pub0 = targets[0][2]
        params = [(n, t.nbytes) for n, t in sorted(pub0.params.items(), key=lambda kv: kv[1].data_ptr)]
    remote = {eid: [pub.target(n, nb, engine=ename).data_ptr for n, nb in params] for eid, ename, pub in targets}
    starts = np.cumsum([0] + [nb for _, nb in params])
    total = int(starts[-1])
    if total > stream.size:
        raise ValueError(f"the stream holds {stream.size} bytes, the parameters {total}")
    slot_bytes = buffers.slot_bytes
    pos = k = 0
    while pos < total:
        n = min(slot_bytes, total - pos)
        slot = writer.acquire()
        try:
            buffers.slot_array(slot)[:n] = stream[pos:pos + n]
            rows = []
            i = int(np.searchsorted(starts, pos, side="right")) - 1
            while i < len(params) and starts[i] < pos + n:
                lo, hi = max(int(starts[i]), pos), min(int(starts[i + 1]), pos + n)
                for eid, _, _ in targets:
                    rows.append((lo - pos, hi - lo, eid, remote[eid][i] + (lo - int(starts[i]))))
                i += 1
            writer.submit(slot, rows)
        except BaseException:
            if writer.pending_batches(slot) == 0:
                try:
                    writer.release_slot(slot)
                except Exception:
                    pass
            raise
        pos += n
        if on_submit is not None:
            on_submit(k)
        k += 1
    return writer.finish() if finish else None


if __name__ == "__main__":
    sys.exit(main())
