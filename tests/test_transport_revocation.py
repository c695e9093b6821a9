"""Revocation per epoch at the transport level (transport/revocation.py), between real processes:
a sender holding the old epoch's connection is stopped, the engine rank revokes (a new endpoint for
the same memory, the old one closed), the sender resumes and posts: nothing lands. Without the
revocation the same posts land (the control), so the test can fail."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

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
