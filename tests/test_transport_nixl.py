"""The transport cases (transport_cases.py) over NIXL (UCX), on 127.0.0.1."""
import pytest

from transport_cases import *  # noqa: F401,F403  (the test functions and their fixtures)


@pytest.fixture
def backend() -> str:
    return "nixl"


def test_a_completed_request_is_reposted_by_the_next_identical_batch_and_dropped_on_disconnect(peers):
    import time

    from p2pweights.sender.buffers import TransferBuffers
    from p2pweights.transport import make_backend
    from p2pweights.transport.nixl import DONE, IN_PROGRESS

    peer = peers(0, size=16 << 20)
    backend = make_backend("nixl")
    made = []
    initialize = backend.agent.initialize_xfer
    backend.agent.initialize_xfer = lambda *a, **k: made.append(a) or initialize(*a, **k)
    with TransferBuffers(2 << 20, 1) as buf:
        backend.register_memory(buf.address, buf.total_bytes, buf.location)
        backend.connect(0, peer.publication.descriptor)
        targets = list(peer.publication.params.values())[:2]

        def write(local_offset: int) -> None:
            rid = backend.post(0, [buf.address + local_offset, buf.address + local_offset + 4096],
                               [t.data_ptr for t in targets], [4096, 4096])
            deadline = time.monotonic() + 10
            while (state := backend.poll(rid)) == IN_PROGRESS and time.monotonic() < deadline:
                time.sleep(0.001)
            assert state == DONE
            backend.release(rid)

        write(0)
        write(0)  # the same batch again: the kept request is re-posted
        assert len(made) == 1
        write(8192)  # another batch: a new request
        assert len(made) == 2 and len(backend._kept) == 2
        backend.disconnect(0)
        assert not backend._kept  # requests of a gone connection are released
        backend.deregister_memory(buf.address)
    backend.close()


def test_sender_transport_takes_the_settings_transport_options():
    from p2pweights.settings import settings
    from p2pweights.transport import make_sender_transport

    s = settings(transport="nixl", nixl_progress_delay_us=250)
    t = make_sender_transport(s.transport, **s.transport_options())
    try:
        assert t.backend.plugin == s.nixl_backend == "UCX"
    finally:
        t.close()
    with pytest.raises(TypeError, match="takes no option protocol"):
        make_sender_transport("nixl", protocol="tcp")  # a Mooncake option is refused, not dropped


def test_progress_delay_is_read_through_the_settings_registry(monkeypatch):
    from p2pweights.settings import SettingError
    from p2pweights.transport.nixl import progress_delay_us

    monkeypatch.setenv("P2PW_NIXL_PROGRESS_DELAY_US", "250")
    assert progress_delay_us() == 250
    monkeypatch.setenv("P2PW_NIXL_PROGRESS_DELAY_US", "-3")
    with pytest.raises(SettingError, match="P2PW_NIXL_PROGRESS_DELAY_US"):
        progress_delay_us()
