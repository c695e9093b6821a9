"""Mooncake over TCP, what p2pweights sets: MooncakeBackend.poll asks the pieces of a request in the
order submitted, up to the first one still running (a poll costs the pieces that ended since the
last one, not every piece of the slot); engines over tcp use 16 connections per peer unless the
user set MC_TCP_LANES_PER_PEER."""
from __future__ import annotations

import json
import os
import time

import pytest

from p2pweights.transport import mooncake
from test_transport_mooncake import _Engine


class _CountingEngine(_Engine):
    """test_transport_mooncake's stand-in engine (Mooncake's status semantics: a finished write is
    freed when read, read again is an error), counting the status reads."""

    def __init__(self):
        super().__init__()
        self.reads: list[int] = []

    def transfer_check_status(self, bid):
        self.reads.append(bid)
        return super().transfer_check_status(bid)


@pytest.fixture
def stand_in(monkeypatch):
    engine = _CountingEngine()
    monkeypatch.setattr(mooncake, "new_engine", lambda *a, **k: (engine, "127.0.0.1:1"))
    backend = mooncake.MooncakeBackend()
    backend.connect(0, json.dumps({"transport": "mooncake", "peer": "127.0.0.1:9"}))
    return backend, engine


def _four_pieces(backend):
    return backend.post(0, [0x1000, 0x9000, 0x11000, 0x19000], [0x5000, 0x20000, 0x40000, 0x60000], [64] * 4)


def test_a_poll_reads_up_to_the_first_running_piece_only(stand_in):
    backend, engine = stand_in
    rid = _four_pieces(backend)
    assert backend.poll(rid) == mooncake.IN_PROGRESS
    assert engine.reads == [101]
    engine.state[101] = engine.state[102] = 1
    engine.reads.clear()
    assert backend.poll(rid) == mooncake.IN_PROGRESS
    assert engine.reads == [101, 102, 103]
    engine.state[103] = engine.state[104] = 1
    assert backend.poll(rid) == mooncake.DONE
    assert backend.release(rid) is None


def test_a_failed_piece_behind_a_running_one_fails_the_request_once_reached_and_holds_the_slot(stand_in):
    backend, engine = stand_in
    rid = _four_pieces(backend)
    engine.state[102] = -1
    assert backend.poll(rid) == mooncake.IN_PROGRESS  # 101 still runs: 102 not read yet
    engine.state[101] = 1
    code, why = backend.poll(rid)
    assert code < 0 and "127.0.0.1:9" in why
    assert backend.release(rid) == mooncake.IN_PROGRESS  # 103 and 104 still read the slot
    engine.state[103] = engine.state[104] = 1
    assert backend.release(rid) is None
    assert backend.abandoned_writes() == 0


def test_real_mooncake_many_pieces_land_byte_exact_with_a_status_read_per_ended_piece_and_poll():
    """Real Mooncake over TCP into a receiver process: 64 parameters with unpublished gaps between
    them (nothing joins), written as one request and polled at once and then with a backoff."""
    from p2pweights.sender.buffers import TransferBuffers
    from p2pweights.transport.peer import PeerProcess, pattern

    params, each = 64, 1 << 20
    peer = PeerProcess("mooncake", params * each, params=params, gap=4096)
    backend = mooncake.MooncakeBackend()
    src = TransferBuffers(params * each, 1)
    try:
        src.slot_array(0)[:] = pattern(params * each, 5)
        backend.register_memory(src.address, src.total_bytes)
        backend.connect(0, peer.publication_json)
        targets = sorted(peer.publication.params.values(), key=lambda t: t.data_ptr)
        reads = []
        real_check = backend.engine.transfer_check_status

        class Counting:  # the engine, with its status reads counted
            def __getattr__(self, name):
                return getattr(engine, name)

            def transfer_check_status(self, bid):
                reads.append(bid)
                return real_check(bid)

        engine, backend.engine = backend.engine, Counting()
        rid = backend.post(0, [src.address + i * each for i in range(params)], [t.data_ptr for t in targets],
                           [each] * params)
        polls, sleep = 0, 20e-6
        while True:
            polls += 1
            rc = backend.poll(rid)
            if rc != mooncake.IN_PROGRESS:
                break
            time.sleep(sleep)
            sleep = min(sleep * 2, 2e-3)
        assert rc == mooncake.DONE
        assert backend.release(rid) is None
        assert len(set(reads)) == params  # every piece was seen to end
        assert len(reads) <= params + polls  # each poll: the pieces that ended since, plus one running
        backend.engine = engine
        assert peer.check(5) == 0
    finally:
        backend.close()
        src.close()
        peer.close()


def test_a_tcp_engine_gets_16_lanes_per_peer_unless_the_user_set_them(monkeypatch):
    monkeypatch.delenv("MC_TCP_LANES_PER_PEER", raising=False)
    mooncake.new_engine(protocol="tcp")
    assert os.environ["MC_TCP_LANES_PER_PEER"] == "16"
    monkeypatch.setenv("MC_TCP_LANES_PER_PEER", "2")
    mooncake.new_engine(protocol="tcp")
    assert os.environ["MC_TCP_LANES_PER_PEER"] == "2"
