"""The sglang plugin's rank side of a takeover (sglang_plugin/rank_epochs.py) with sglang's own Mooncake
engine as epoch 1 (``SglangEndpoint``), over real Mooncake TCP on loopback, without a server:

- a request already mid-write into sglang's engine when the rank revokes lands nothing more once the
  rank answered, although the engine stays referenced (as sglang's load config keeps it): the fence
  cuts its connections, it does not rely on the engine being destroyed;
- a fence that overruns ``P2PW_REVOKE_TIMEOUT`` is the rank's answer (``error``, type
  ``RevocationFailed``): nothing is re-published, and the launcher fails the begin.
"""
from __future__ import annotations

import json
import socket
import struct
import threading
import time

import numpy as np
import pytest

from p2pweights.sglang_plugin import rank_epochs
from p2pweights.transport.mooncake import MooncakeReceiver, new_engine
from p2pweights.transport.revocation import RevocableRegions

NBYTES = 16 << 20


class _Transporter:
    """What rank_revoke touches of sglang's RemoteInstanceWeightTransporter: its engine, session id and
    its PUT to the bootstrap server (recorded here)."""

    def __init__(self, engine, session_id: str):
        self.engine, self.session_id, self.puts = engine, session_id, []

    def _register_to_engine_info_bootstrap(self) -> None:
        self.puts.append(self.session_id)


class _HeldSglangEndpoint(rank_epochs.SglangEndpoint):
    """sglang's engine whose fence hangs until released (a transport call that does not return)."""

    release = threading.Event()

    def fence(self, deadline: float) -> int:
        self.release.wait()
        return super().fence(deadline)


@pytest.fixture
def sglang_rank(monkeypatch):
    """sglang's own engine with the rank's weights registered (as sglang registers them), adopted as
    epoch 1 the way ``rank_epochs.adopt`` does; yields (weights, engine, transporter, make_regions)."""
    engine, session_id = new_engine("127.0.0.1", "tcp")
    weights = np.zeros(NBYTES, dtype=np.uint8)
    assert engine.register_memory(weights.ctypes.data, NBYTES, "*") == 0
    transporter = _Transporter(engine, session_id)
    made = []

    def make_regions(endpoint_class=rank_epochs.SglangEndpoint, **kw):
        endpoint = endpoint_class(engine, session_id, [(weights.ctypes.data, NBYTES)], protocol="tcp")
        regions = RevocableRegions("mooncake", [(weights.ctypes.data, NBYTES, "cpu")],
                                   {"w": [weights.ctypes.data, NBYTES // 2, 2]}, 0, endpoint=endpoint,
                                   make_endpoint=lambda t: MooncakeReceiver(hostname="127.0.0.1", protocol="tcp"), **kw)
        monkeypatch.setattr(rank_epochs, "REGIONS", regions)
        monkeypatch.setattr(rank_epochs, "TRANSPORTER", transporter)
        made.append(regions)
        return regions

    yield weights, engine, transporter, make_regions
    _HeldSglangEndpoint.release.set()
    for regions in made:
        if regions.epoch > 1:
            regions.close()


def test_a_request_mid_write_into_sglangs_engine_lands_nothing_after_the_rank_answered(sglang_rank):
    weights, engine, transporter, make_regions = sglang_rank
    regions = make_regions()
    # a peer speaking Mooncake's TCP framing: a WRITE header for the whole region, then 1 MiB of its body
    peer = socket.create_connection(("127.0.0.1", regions.endpoint.data_port), timeout=10)
    peer.sendall(struct.pack("<QQB7x", NBYTES, weights.ctypes.data, 1) + b"\xcd" * (1 << 20))
    deadline = time.monotonic() + 20
    while np.count_nonzero(weights) < 1 << 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert np.count_nonzero(weights) == 1 << 20  # accepted: its address was checked at the header

    answer = rank_epochs.rank_revoke(0, json.dumps({rank_epochs.EPOCH_KEY: 2}))
    assert "error" not in answer, answer
    print(f"\nrank revoked sglang's engine mid-write in {answer['seconds'] * 1e3:.0f} ms "
          f"(fence {answer['fence_seconds'] * 1e3:.1f} ms)")
    assert answer[rank_epochs.EPOCH_KEY] == 2 and transporter.puts == [answer["peer"]]
    assert transporter.engine is regions.endpoint.engine and transporter.engine is not engine
    try:
        for _ in range(8):  # the rest of the body
            peer.sendall(b"\xcd" * (1 << 20))
    except OSError:
        pass
    finally:
        peer.close()
    time.sleep(0.5)
    assert np.count_nonzero(weights) == 1 << 20  # not one byte after the answer
    assert engine.get_rpc_port() > 0  # sglang's engine is still alive (it keeps it): the cut did it


def test_a_rank_whose_fence_overruns_the_timeout_answers_revocation_failed(sglang_rank):
    weights, engine, transporter, make_regions = sglang_rank
    _HeldSglangEndpoint.release.clear()
    regions = make_regions(_HeldSglangEndpoint, revoke_timeout=0.5)
    t0 = time.monotonic()
    answer = rank_epochs.rank_revoke(0, json.dumps({rank_epochs.EPOCH_KEY: 2}))
    took = time.monotonic() - t0
    assert answer["error"]["type"] == "RevocationFailed", answer
    assert "not fenced within 0.5 s" in answer["error"]["message"] and answer["error"]["rank"] == 0
    assert took < 5, took
    # nothing moved: no PUT, sglang's transporter still holds its own engine, the rank still at epoch 1
    assert transporter.puts == [] and transporter.engine is engine and regions.epoch == 1
    _HeldSglangEndpoint.release.set()
    answer = rank_epochs.rank_revoke(0, json.dumps({rank_epochs.EPOCH_KEY: 2}))  # the next takeover finishes it
    assert "error" not in answer and answer[rank_epochs.EPOCH_KEY] == 2, answer
