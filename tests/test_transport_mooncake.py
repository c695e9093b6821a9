"""The transport cases (transport_cases.py) over Mooncake Transfer Engine, on 127.0.0.1, and how
the Mooncake backend holds a slot while a write it abandoned may still read it."""
import json
import time

import pytest

from transport_cases import *  # noqa: F401,F403  (the test functions and their fixtures)


@pytest.fixture
def backend() -> str:
    return "mooncake"


# -- abandoned writes hold their slot (invariant 2), with Mooncake's engine replaced by a stand-in --------
class _Engine:
    """transfer_submit_write / transfer_check_status as Mooncake's: a status read of a finished write
    frees it, and reading it again is an error (the test fails on it)."""

    def __init__(self, fail_submit_at: int = -1):
        self.state: dict[int, int] = {}
        self.freed: set[int] = set()
        self.fail_submit_at = fail_submit_at
        self.submits = 0

    def transfer_submit_write(self, session, local, remote, length):
        self.submits += 1
        if self.submits == self.fail_submit_at:
            return -1
        bid = 100 + self.submits
        self.state[bid] = 0
        return bid

    def transfer_check_status(self, bid):
        assert bid not in self.freed, f"batch {bid} read after Mooncake freed it"
        rc = self.state[bid]
        if rc in (1, -1):
            self.freed.add(bid)
        return rc

    def get_first_buffer_address(self, session):
        return 1


@pytest.fixture
def fake_mooncake(monkeypatch):
    from p2pweights.transport import mooncake

    def make(**kw):
        engine = _Engine(**kw)
        monkeypatch.setattr(mooncake, "new_engine", lambda *a, **k: (engine, "127.0.0.1:1"))
        b = mooncake.MooncakeBackend()
        b.connect(0, json.dumps({"transport": "mooncake", "peer": "127.0.0.1:9"}))
        return b, engine

    return make


def test_a_write_released_in_flight_keeps_its_slot_until_mooncake_ends_it(fake_mooncake):
    from p2pweights.transport.mooncake import IN_PROGRESS

    backend, engine = fake_mooncake()
    rid = backend.post(0, [0x1000, 0x9000], [0x5000, 0x20000], [64, 64])  # two pieces
    assert backend.poll(rid) == IN_PROGRESS
    assert backend.release(rid) == IN_PROGRESS  # the deadline passed; Mooncake cannot cancel
    engine.state[101] = 1
    assert backend.release(rid) == IN_PROGRESS  # one piece still reads the slot
    engine.state[102] = -1
    assert backend.release(rid) is None
    assert backend.abandoned_writes() == 0


def test_pieces_left_running_after_a_failed_piece_hold_the_slot(fake_mooncake):
    from p2pweights.transport.mooncake import IN_PROGRESS

    backend, engine = fake_mooncake()
    rid = backend.post(0, [0x1000, 0x9000, 0x11000], [0x5000, 0x20000, 0x40000], [64, 64, 64])
    engine.state[101] = -1
    code, why = backend.poll(rid)
    assert code < 0 and "127.0.0.1:9" in why
    assert backend.release(rid) == IN_PROGRESS  # 102 and 103 still run
    engine.state[102] = engine.state[103] = 1
    assert backend.release(rid) is None


def test_a_submit_failing_mid_batch_returns_a_failed_request_that_holds_the_slot(fake_mooncake):
    from p2pweights.transport.mooncake import IN_PROGRESS

    backend, engine = fake_mooncake(fail_submit_at=2)
    rid = backend.post(0, [0x1000, 0x9000], [0x5000, 0x20000], [64, 64])  # the first piece went out
    code, why = backend.poll(rid)
    assert code < 0 and "submit failed" in why
    assert backend.release(rid) == IN_PROGRESS
    engine.state[101] = 1
    assert backend.release(rid) is None


def test_a_stopped_engine_keeps_its_slots_until_its_abandoned_writes_end(peers, sender):
    """Real Mooncake over TCP: writes to a stopped engine cannot be cancelled at the deadline, so the
    slots they read are not handed out again until the engine resumes and they end."""
    from p2pweights.errors import TransferTimeout, UpdateFailed
    from transport_cases import stream

    a, b = peers(0), peers(1)
    s = sender(timeout=2.0)
    s.attach(0, a)
    s.attach(1, b)
    stream(8)
    b.stop()
    with pytest.raises(UpdateFailed, match="transfer timeout"):
        s.push(8)
    assert s.writer.draining_batches() > 0
    with pytest.raises(TransferTimeout):
        for _ in range(s.buffers.num_slots):
            s.writer.acquire(timeout=0.3)  # at least one slot is still read by an abandoned write
    b.cont()
    deadline = time.monotonic() + 20
    while s.writer.draining_batches() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.writer.draining_batches() == 0
    for slot in range(s.buffers.num_slots):
        if s.writer.pending_batches(slot) == 0:
            continue
        pytest.fail(f"slot {slot} still taken")


def test_sender_transport_takes_the_settings_transport_options(monkeypatch):
    from p2pweights.settings import settings
    from p2pweights.transport import make_sender_transport

    s = settings(transport="mooncake", mooncake_protocol="tcp", hostname="127.0.0.1")
    t = make_sender_transport(s.transport, **s.transport_options())
    try:
        assert t.backend.protocol == "tcp" and t.backend.session_id.startswith("127.0.0.1:")
    finally:
        t.close()
    with pytest.raises(TypeError, match="takes no option progress_delay"):
        make_sender_transport("mooncake", progress_delay=5)


def test_the_advertised_hostname_is_read_through_the_settings_registry(monkeypatch):
    from p2pweights.transport.mooncake import default_hostname, default_protocol

    monkeypatch.setenv("P2PW_HOSTNAME", "10.1.2.3")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "tcp")  # the vendor's variable, honoured by the registry
    assert default_hostname() == "10.1.2.3" and default_protocol() == "tcp"
