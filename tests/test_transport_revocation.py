"""Revocation per epoch at the transport level (transport/revocation.py), between real processes.

- A sender holding the old epoch's connection is stopped, the engine rank revokes (a new endpoint for
  the same memory, the old one fenced), the sender resumes and posts: nothing lands. Without the
  revocation the same posts land (the control), so the test can fail.
- A request already mid-write when the engine revokes (a sender stopped inside one 256 MiB write; a
  raw peer that sent Mooncake's header and part of the body): not one byte lands after ``revoke()``
  returned. The control: unregistering alone (Mooncake checks the address at the header only) lets
  the rest land, and the sender is told it succeeded.
- The revocation's bound: a fence that hangs past ``P2PW_REVOKE_TIMEOUT`` or fails raises
  RevocationFailed, publishes nothing, and the next revocation finishes it; a healthy one fences in
  milliseconds.
"""
from __future__ import annotations

import json
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from p2pweights.transport.peer import PeerProcess, wait_stopped

CHILD = r'''
import json, os, signal, sys, time
import numpy as np
from p2pweights.transport import make_backend
from p2pweights.transport.publication import EnginePublication
transport, pubjson = sys.argv[1], sys.argv[2]
pub = EnginePublication.from_json(json.loads(pubjson))
be = make_backend(transport)
buf = np.full(1 << 20, 0xAB, dtype=np.uint8)
be.register_memory(buf.ctypes.data, buf.nbytes, "cpu")
be.connect(0, pub.descriptor)
base = min(t.data_ptr for t in pub.params.values())
first = be.post(0, [buf.ctypes.data], [base], [1 << 20])
while be.poll(first) == 1:
    time.sleep(0.001)
print(json.dumps({"connected": True}), flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
results = []
for i in range(8):
    try:
        r = be.post(0, [buf.ctypes.data], [base + i * (1 << 20)], [1 << 20])
    except Exception as e:
        results.append(type(e).__name__)
        continue
    t0 = time.time()
    while be.poll(r) == 1 and time.time() - t0 < 20:
        time.sleep(0.001)
    results.append(str(be.poll(r)))
print(json.dumps({"results": results}), flush=True)
'''


@pytest.mark.parametrize("revoke", [False, True], ids=["control", "revoked"])
@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_a_stopped_sender_of_a_revoked_epoch_lands_nothing(transport, revoke):
    peer = PeerProcess(transport, size="16MiB", params=16)
    child = subprocess.Popen([sys.executable, "-c", CHILD, transport, peer.publication_json],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert json.loads(child.stdout.readline())["connected"]
        wait_stopped(child.pid)
        peer.zero()
        if revoke:
            before = peer.publication.peer
            peer.revoke()
            assert peer.publication.peer != before and peer.publication.epoch == 2
        child.send_signal(signal.SIGCONT)
        results = json.loads(child.stdout.readline())["results"]
        child.wait(60)
        time.sleep(0.5)
        landed = peer.nonzero()
        if revoke:
            assert landed == 0, (landed, results)
            assert "0" not in results, results  # no post reported success
        else:
            assert landed == 8 << 20, (landed, results)  # the control: the same posts land unrevoked
    finally:
        if child.poll() is None:
            child.kill()
        child.wait(10)
        peer.close()


# -- a request mid-write at the moment of revocation, and the revocation's bound --------------------
# An engine rank in its own process: one region of N bytes (zeroed) held by RevocableRegions over
# Mooncake TCP, answering line commands. "unregister" is the control: what unregistering alone does
# (what the sglang plugin's epoch 1 did before fencing): Mooncake checks a request's address only at
# its header, so a request it had accepted goes on writing.
RECEIVER = r'''
import json, mmap, os, sys, time
import numpy as np
from p2pweights.transport.revocation import RevocableRegions
out = os.fdopen(os.dup(1), "w"); os.dup2(2, 1)
n, transport = int(sys.argv[1]), sys.argv[2]
region = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
buf = np.frombuffer(region, dtype=np.uint8); buf[:] = 0
base = buf.ctypes.data
regions = RevocableRegions(transport, [(base, n, "cpu")], {"w": [base, n // 2, 2]}, 0)
def say(**kw): print(json.dumps(kw), file=out, flush=True)
say(publication=regions.publication.to_dict(), base=base, data_port=getattr(regions.endpoint, "data_port", None))
for line in sys.stdin:
    cmd = line.strip()
    if cmd == "nonzero":
        say(nonzero=int(np.count_nonzero(buf)))
    elif cmd == "revoke":
        t0 = time.perf_counter()
        regions.revoke(regions.epoch + 1)
        say(seconds=time.perf_counter() - t0, fence_seconds=regions.fence_seconds, epoch=regions.epoch)
    elif cmd == "unregister":
        say(rc=regions.endpoint.engine.unregister_memory(base))
    elif cmd == "exit":
        break
'''

# A sender in its own process: one write of the whole region (one Mooncake request: one header, then
# the body in 64 KiB chunks), then it stops itself DELAY seconds later, inside the write.
STOPPED_WRITER = r'''
import json, os, signal, sys, time
import numpy as np
from p2pweights.transport import make_backend
from p2pweights.transport.publication import EnginePublication
pub = EnginePublication.from_json(json.loads(sys.argv[1]))
n, delay = int(sys.argv[2]), float(sys.argv[3])
be = make_backend(pub.transport)
src = np.full(n, 0xAB, dtype=np.uint8)
be.register_memory(src.ctypes.data, n, "cpu")
be.connect(0, pub.descriptor)
print(json.dumps({"connected": True}), flush=True)
sys.stdin.readline()
req = be.post(0, [src.ctypes.data], [pub.params["w"].data_ptr], [n])
time.sleep(delay)
os.kill(os.getpid(), signal.SIGSTOP)
t0 = time.time()
while (rc := be.poll(req)) == 1 and time.time() - t0 < 30:
    time.sleep(0.005)
print(json.dumps({"poll": rc if isinstance(rc, int) else list(rc)}), flush=True)
'''


class _Rank:
    """The RECEIVER process."""

    def __init__(self, nbytes: int, transport: str = "mooncake"):
        self.proc = subprocess.Popen([sys.executable, "-c", RECEIVER, str(nbytes), transport], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        hello = self._read()
        self.publication_json = json.dumps(hello["publication"])
        self.base, self.data_port = hello["base"], hello["data_port"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine rank exited ({self.proc.poll()})")
        return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def settled_nonzero(self) -> int:
        """Bytes landed once what the kernel buffered has drained into the region (two equal counts)."""
        last = -1
        while (now := self.ask("nonzero")["nonzero"]) != last:
            last = now
            time.sleep(0.2)
        return now

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("exit\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _mid_write(rank: _Rank, nbytes: int, revoke: str) -> dict:
    """A Mooncake sender stopped inside one write of ``nbytes``; ``revoke`` on the engine rank; the sender
    resumed. What landed before, at, and after the revocation, and what the sender's poll said; None when
    the stop missed the write (nothing or everything had landed), so the caller tries another delay."""
    for delay in (0.03, 0.01, 0.06, 0.003, 0.1):
        child = subprocess.Popen([sys.executable, "-c", STOPPED_WRITER, rank.publication_json, str(nbytes),
                                  str(delay)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert json.loads(child.stdout.readline())["connected"]
            child.stdin.write("go\n")
            child.stdin.flush()
            wait_stopped(child.pid)
            before = rank.settled_nonzero()
            if not 0 < before < nbytes:
                continue  # the stop came before the first byte or after the last: not mid-write
            answer = rank.ask(revoke)
            at_return = rank.ask("nonzero")["nonzero"]
            child.send_signal(signal.SIGCONT)
            poll = json.loads(child.stdout.readline())["poll"]
            child.wait(60)
            after = rank.settled_nonzero()
            return {"before": before, "at_return": at_return, "after": after, "answer": answer, "poll": poll,
                    "delay": delay}
        finally:
            if child.poll() is None:
                child.send_signal(signal.SIGCONT)
                child.kill()
            child.wait(10)
    pytest.skip("the sender's stop never fell inside its write")


MID_WRITE = 256 << 20


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_a_request_mid_write_at_revocation_lands_nothing_after_revoke_returned(transport):
    rank = _Rank(MID_WRITE, transport)
    try:
        r = _mid_write(rank, MID_WRITE, "revoke")
        print(f"\n{transport} mid-write revocation: {r['before'] >> 20} MiB of {MID_WRITE >> 20} MiB landed before, revoke "
              f"{r['answer']['seconds'] * 1e3:.1f} ms (fence {r['answer']['fence_seconds'] * 1e3:.1f} ms), "
              f"{r['after'] - r['at_return']} B after; sender's poll {r['poll']}")
        assert r["after"] == r["at_return"] == r["before"], r  # not one byte after revoke() returned
        assert r["poll"] != 0, r  # the resumed sender is told its write failed
    finally:
        rank.close()


def test_control_unregistering_alone_lets_a_request_mid_write_land_its_remaining_bytes():
    """Why the revocation cuts connections: Mooncake checks an address at the request's header only."""
    rank = _Rank(MID_WRITE)
    try:
        r = _mid_write(rank, MID_WRITE, "unregister")
        print(f"\nunregister alone: {r['before'] >> 20} MiB landed before, {(r['after'] - r['at_return']) >> 20} MiB "
              f"after; sender's poll {r['poll']}")
        assert r["answer"]["rc"] == 0
        assert r["after"] == MID_WRITE, r  # every remaining byte landed after the unregister
        assert r["poll"] == 0, r           # and the sender was told it succeeded
    finally:
        rank.close()


def _raw_request(port: int, address: int, nbytes: int) -> socket.socket:
    """A peer that speaks Mooncake's TCP framing itself: one WRITE header (size, address, opcode; the
    C struct SessionHeader, 24 bytes), no body yet."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(struct.pack("<QQB7x", nbytes, address, 1))
    return s


@pytest.mark.parametrize("revoke", ["revoke", "unregister"], ids=["revoked", "control-unregister-only"])
def test_a_raw_peer_that_sent_its_header_and_part_of_the_body_lands_nothing_after_revocation(revoke):
    rank = _Rank(16 << 20)
    try:
        s = _raw_request(rank.data_port, rank.base, 16 << 20)
        s.sendall(b"\xcd" * (1 << 20))
        deadline = time.monotonic() + 20
        while rank.ask("nonzero")["nonzero"] < 1 << 20 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert rank.ask("nonzero")["nonzero"] == 1 << 20  # the request was accepted: its header is checked
        rank.ask(revoke)
        sent = 1 << 20
        try:
            for _ in range(8):  # the rest of the body, 1 MiB at a time
                s.sendall(b"\xcd" * (1 << 20))
                sent += 1 << 20
        except OSError:
            pass
        finally:
            s.close()
        time.sleep(0.5)
        landed = rank.settled_nonzero()
        if revoke == "revoke":
            assert landed == 1 << 20, (landed, sent)
        else:
            assert landed == sent == 9 << 20, (landed, sent)  # the control: the accepted request went on
    finally:
        rank.close()


# -- the revocation's bound, and the state a failed one leaves ---------------------------------------
class _HeldFence:
    """A real Mooncake endpoint whose fence first waits until ``release`` is set (a transport call that
    hangs: a stuck io thread, an unregistration that does not return), or raises ``error``."""

    name = "mooncake"

    def __init__(self, error: Exception | None = None):
        from p2pweights.transport.mooncake import MooncakeReceiver

        self.endpoint = MooncakeReceiver(hostname="127.0.0.1", protocol="tcp")
        self.release = threading.Event()
        self.error = error
        self.fences = 0

    @property
    def peer(self) -> str:
        return self.endpoint.peer

    def register(self, addr: int, length: int, location: str = "cpu") -> None:
        self.endpoint.register(addr, length, location)

    def publication(self, params, rank=0):
        return self.endpoint.publication(params, rank)

    def fence(self, deadline: float) -> int:
        self.fences += 1
        if self.error is not None:
            raise self.error
        self.release.wait()
        return self.endpoint.fence(deadline)

    def close(self) -> None:
        self.endpoint.close()


def _regions_on(endpoint, nbytes: int = 1 << 20, **kw):
    from p2pweights.transport.revocation import RevocableRegions

    buf = np.zeros(nbytes, dtype=np.uint8)
    endpoint.register(buf.ctypes.data, nbytes, "cpu")
    regions = RevocableRegions("mooncake", [(buf.ctypes.data, nbytes, "cpu")], {"w": [buf.ctypes.data, nbytes // 2, 2]},
                               0, endpoint=endpoint, **kw)
    return regions, buf


def _writes_through(publication_json: str) -> bool:
    """Whether a fresh sender (its own process) can still write through a publication."""
    code = r'''
import json, sys
import numpy as np
from p2pweights.transport import make_backend
from p2pweights.transport.publication import EnginePublication
pub = EnginePublication.from_json(json.loads(sys.argv[1]))
be = make_backend("mooncake")
src = np.full(4096, 7, dtype=np.uint8)
be.register_memory(src.ctypes.data, src.nbytes, "cpu")
try:
    be.connect(0, pub.descriptor)
except Exception as e:
    print("refused", type(e).__name__); sys.exit(0)
import time
r = be.post(0, [src.ctypes.data], [pub.params["w"].data_ptr], [4096])
while be.poll(r) == 1:
    time.sleep(0.001)
print("landed" if be.poll(r) == 0 else f"failed {be.poll(r)}")
'''
    out = subprocess.run([sys.executable, "-c", code, publication_json], capture_output=True, text=True, timeout=120)
    return out.stdout.strip() == "landed"


def test_a_fence_that_hangs_past_the_timeout_fails_the_revocation_and_the_next_one_finishes_it():
    from p2pweights.errors import EngineError, RevocationFailed

    held = _HeldFence()
    regions, buf = _regions_on(held, revoke_timeout=0.5)
    first = regions.publication
    try:
        t0 = time.monotonic()
        with pytest.raises(RevocationFailed, match="not fenced within 0.5 s") as info:
            regions.revoke(2)
        took = time.monotonic() - t0
        print(f"\nrevoke with a hung fence failed after {took:.2f} s (timeout 0.5 s)")
        assert isinstance(info.value, EngineError) and info.value.rank == 0
        assert took < 5
        # nothing was published: the rank still answers epoch 1's endpoint, and the caller leaves the engine torn
        assert (regions.epoch, regions.publication, regions.endpoint) == (1, first, held)
        assert _writes_through(json.dumps(first.to_dict()))  # the hung fence did nothing yet
        with pytest.raises(RevocationFailed, match="still running"):  # a retry waits for it, bounded too
            regions.revoke(2, timeout=0.3)
        held.release.set()  # the transport call returns
        publication = regions.revoke(2)
        assert regions.epoch == 2 and publication.peer != first.peer and held.fences == 2
        assert not _writes_through(json.dumps(first.to_dict()))  # epoch 1 is fenced now
        assert _writes_through(json.dumps(publication.to_dict()))
    finally:
        held.release.set()
        regions.close()


def test_a_fence_that_fails_fails_the_revocation_naming_the_cause():
    from p2pweights.errors import RevocationFailed, TransportError

    held = _HeldFence(error=TransportError("Mooncake engine x refused to unregister 1 region(s)"))
    regions, buf = _regions_on(held)
    first = regions.publication
    try:
        with pytest.raises(RevocationFailed, match="could not be fenced.*refused to unregister") as info:
            regions.revoke(2)
        assert isinstance(info.value.__cause__, TransportError)
        assert (regions.epoch, regions.publication) == (1, first)
    finally:
        held.close()


def test_a_healthy_revocation_fences_in_milliseconds():
    """The fence adds little to a revocation (a new endpoint opened and registered dominates it)."""
    from p2pweights.transport.mooncake import MooncakeReceiver

    regions, buf = _regions_on(MooncakeReceiver(hostname="127.0.0.1", protocol="tcp"), nbytes=64 << 20)
    try:
        times = []
        for epoch in (2, 3, 4):
            t0 = time.perf_counter()
            regions.revoke(epoch)
            times.append((time.perf_counter() - t0, regions.fence_seconds))
            time.sleep(1.2)  # the old endpoint's close (its own thread) ends
        print("\nhealthy revocations (64 MiB): " + ", ".join(f"{t * 1e3:.0f} ms (fence {f * 1e3:.1f} ms)"
                                                             for t, f in times))
        assert all(f < 1.0 for _, f in times), times
    finally:
        regions.close()
