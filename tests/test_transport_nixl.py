"""The transport cases (transport_cases.py) over NIXL (UCX), on 127.0.0.1, through both sender data
paths: native (NIXL's C API, no GIL) and Python (NIXL's Python API). The receivers are always the
Python NixlReceiver (in peer processes)."""
import base64
import json
import sys
import time

import pytest

from p2pweights import _native
from p2pweights.errors import TransportError, UpdateFailed
from p2pweights.transport.publication import EnginePublication, ParamTarget
from transport_cases import *  # noqa: F401,F403  (the test functions and their fixtures)
from transport_cases import SIZE, SLOT, stream


@pytest.fixture(params=["native", "python"])
def nixl_api(request, monkeypatch) -> str:
    monkeypatch.setenv("P2PW_NIXL_API", request.param)
    return request.param


@pytest.fixture
def backend(nixl_api) -> str:
    return "nixl"


native_only = pytest.mark.parametrize("nixl_api", ["native"], indirect=True)
python_only = pytest.mark.parametrize("nixl_api", ["python"], indirect=True)


@python_only
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
        assert getattr(t, "backend", t).plugin == s.nixl_backend == "UCX"  # Python backend, or the native one
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


# -- the native data path ------------------------------------------------------------------------
def test_the_native_path_is_taken_where_the_c_api_loads_and_either_can_be_forced(monkeypatch):
    from p2pweights.transport import make_sender_transport, nixl_native

    monkeypatch.setenv("P2PW_NIXL_API", "auto")
    assert nixl_native.data_path()["path"] == "native"
    t = make_sender_transport("nixl")
    try:
        assert isinstance(t, nixl_native.NativeNixlTransport) and t.library == nixl_native.capi_library()
    finally:
        t.close()
    monkeypatch.setenv("P2PW_NIXL_API", "python")
    assert nixl_native.data_path() == {"path": "python", "library": nixl_native.capi_library(),
                                       "reason": "P2PW_NIXL_API=python"}
    t = make_sender_transport("nixl")
    try:
        assert isinstance(t, _native.PyTransport) and t.backend.plugin == "UCX"
    finally:
        t.close()
    # Where no wheel ships the C API: auto falls back to Python, native is an error that says so.
    monkeypatch.setattr(nixl_native, "capi_library", lambda: None)
    monkeypatch.setenv("P2PW_NIXL_API", "auto")
    assert nixl_native.data_path()["path"] == "python"
    t = make_sender_transport("nixl")
    assert isinstance(t, _native.PyTransport)
    t.close()
    monkeypatch.setenv("P2PW_NIXL_API", "native")
    with pytest.raises(TransportError, match="P2PW_NIXL_API=native.*libnixl_capi.so"):
        make_sender_transport("nixl")


def test_a_nixl_version_the_c_api_was_not_checked_for_takes_the_python_api_and_doctor_says_why(monkeypatch, capsys):
    import argparse

    from p2pweights.commands import doctor
    from p2pweights.transport import make_sender_transport, nixl_native

    def never(*a, **k):
        raise AssertionError("an unchecked NIXL's C API was loaded")

    monkeypatch.setattr(nixl_native, "nixl_version", lambda: "9.9.9")
    monkeypatch.setattr(nixl_native, "NativeNixlTransport", never)
    monkeypatch.setenv("P2PW_NIXL_API", "auto")
    path = nixl_native.data_path()
    assert path["path"] == "python" and path["library"] == nixl_native.capi_library()
    assert "NIXL 9.9.9 is not a version" in path["reason"] and "1.5.1" in path["reason"], path
    t = make_sender_transport("nixl")
    try:
        assert isinstance(t, _native.PyTransport)
    finally:
        t.close()
    doctor.run(argparse.Namespace(json=False))
    assert f"data path    : python — {path['reason']}" in capsys.readouterr().out
    monkeypatch.setenv("P2PW_NIXL_API", "native")
    with pytest.raises(TransportError, match="P2PW_NIXL_API=native, but NIXL 9.9.9 is not a version"):
        make_sender_transport("nixl")


def test_a_c_api_that_failed_to_load_is_not_tried_again_in_the_process(monkeypatch):
    from p2pweights.errors import NotFound
    from p2pweights.transport import make_sender_transport, nixl_native

    tried = []

    def refuse(library, **opts):
        tried.append(library)
        raise NotFound(f"cannot load NIXL's C API from {library}: not an ELF file")

    monkeypatch.setattr(nixl_native, "_load_failures", {})
    monkeypatch.setattr(nixl_native, "NativeNixlTransport", refuse)
    monkeypatch.setenv("P2PW_NIXL_API", "auto")
    for _ in range(2):
        t = make_sender_transport("nixl")
        t.close()
        assert isinstance(t, _native.PyTransport)
    assert tried == [nixl_native.capi_library()]
    path = nixl_native.data_path()
    assert path["path"] == "python" and "failed to load earlier in this process: cannot load" in path["reason"]


def test_the_native_core_does_not_dlopen_a_refused_library_again(tmp_path):
    import os
    import subprocess

    lib = tmp_path / "libnixl_capi.so"
    lib.write_bytes(b"not an ELF file")
    libc = next(p for p in ("/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6",
                            "/lib64/libc.so.6", "/usr/lib64/libc.so.6") if os.path.exists(p))
    code = ("import shutil, sys\nfrom p2pweights import _native\nfrom p2pweights.errors import NotFound\n"
            "for _ in range(2):\n"
            "    try:\n        _native.NixlTransport(sys.argv[1], 'p2pw-test-agent')\n"
            "    except NotFound as e:\n        print(e)\n"
            "    shutil.copy(sys.argv[2], sys.argv[1])  # a loadable library now: a retry would say it lacks symbols\n")
    out = subprocess.run([sys.executable, "-c", code, str(lib), libc], capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 2 and lines[0] == lines[1], out
    assert lines[0].startswith("cannot load NIXL's C API from " + str(lib)), out


def test_a_library_without_the_c_api_is_refused_by_name_not_loaded_blindly(tmp_path):
    import subprocess

    bogus = tmp_path / "libnixl_capi.so"
    bogus.write_bytes(b"not an ELF file")
    libc = "libc.so.6"  # loads, but has none of the functions
    code = ("import sys\nfrom p2pweights import _native\nfrom p2pweights.errors import NotFound\n"
            "try:\n    _native.NixlTransport(sys.argv[1], 'p2pw-test-agent')\nexcept NotFound as e:\n"
            "    print(e)\n")
    # A fresh process each: the first C API loaded stays the process's one.
    out = subprocess.run([sys.executable, "-c", code, str(bogus)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "cannot load NIXL's C API from " + str(bogus) in out.stdout, out
    out = subprocess.run([sys.executable, "-c", code, libc], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "lacks NIXL C API functions: nixl_capi_create_configured_agent" in out.stdout, out


@pytest.mark.parametrize("nixl_api", ["native", "python"], indirect=True)
def test_a_write_completes_while_a_python_thread_holds_the_gil_only_on_the_native_path(nixl_api, peers, sender):
    """The trainer's Python keeps the GIL (a loop, switch interval 30 s): the native writer threads
    post and poll NIXL anyway; the Python backend's cannot until the GIL is let go."""
    p = peers(0, size=SIZE)
    s = sender()
    s.attach(0, p)
    stream(11)
    drained_while_held = []

    def hold_the_gil(k: int) -> None:
        if k != 0:
            return
        old = sys.getswitchinterval()
        sys.setswitchinterval(30.0)
        try:
            end = time.monotonic() + 5.0
            spins = 0
            # pending_batches neither releases the GIL nor waits on a writer thread that wants it
            while time.monotonic() < end:
                spins += 1
                if s.writer.pending_batches(0) == 0 and s.writer.pending_batches(1) == 0:
                    break
            drained_while_held.append(s.writer.pending_batches(0) == 0 and s.writer.pending_batches(1) == 0)
        finally:
            sys.setswitchinterval(old)

    report = s.push(11, on_submit=hold_the_gil)
    assert report.ok and p.check(11) == 0
    assert drained_while_held == [nixl_api == "native"]


@native_only
def test_identical_batches_repost_their_kept_native_request_and_a_reconnect_drops_them(peers, sender):
    p = peers(0)
    s = sender()
    s.attach(0, p)
    assert s.push(1).ok and p.check(1) == 0
    made = s.transport.stats()["requests_made"]
    assert made == SIZE // SLOT and s.transport.stats()["kept"] == made
    assert s.push(2).ok and p.check(2) == 0  # the same slot packing: every request is re-posted
    st = s.transport.stats()
    assert st["requests_made"] == made and st["requests_reposted"] == made
    s.detach(0)
    assert s.transport.stats()["kept"] == 0  # requests of a gone connection are released
    s.attach(0, p)
    assert s.push(3).ok and p.check(3) == 0
    assert s.transport.stats()["requests_made"] == 2 * made


@native_only
def test_a_write_in_flight_at_the_deadline_is_cancelled_released_and_never_kept(peers, sender):
    p = peers(0, size=SLOT)
    s = sender(timeout=1.0)
    s.attach(0, p)
    stream(12)
    p.stop()  # before the first write: UCX's wire-up needs the peer, so the write stays in flight
    try:
        with pytest.raises(UpdateFailed, match="transfer timeout"):
            s.push(12)
    finally:
        p.cont()
    st = s.transport.stats()
    assert s.writer.draining_batches() == 0 and st["draining"] == 0  # NIXL let go of it: slot free
    assert st["kept"] == 0  # a cancelled request is not re-posted later
    s.detach(0)
    s.attach(0, p)
    assert s.push(13).ok and p.check(13) == 0


@native_only
def test_a_forged_peer_descriptor_is_an_error_status_and_the_transport_still_works(peers, sender):
    p = peers(0, size=SLOT)
    s = sender()
    good = json.loads(p.publication.descriptor)
    for meta in (b"\x00garbage" * 64, p.publication.agent_metadata[: len(p.publication.agent_metadata) // 2]):
        forged = dict(good, agent_metadata=base64.b64encode(meta).decode())
        with pytest.raises(TransportError, match="could not load the agent metadata engine 0 published"):
            s.transport.connect(0, json.dumps(forged))
    with pytest.raises(Exception, match="published no NIXL agent metadata"):
        s.transport.connect(0, json.dumps(dict(good, agent_metadata="")))
    # A weights table pointing past what the engine registered: NIXL refuses the write, the update
    # fails naming the engine, nothing crashes, and an honest table works afterwards.
    pub = p.publication
    beyond = max(t.data_ptr + t.nbytes for t in pub.params.values()) + (64 << 20)
    lying = EnginePublication(transport="nixl", peer=pub.peer, agent_metadata=pub.agent_metadata,
                              location=pub.location, rank=0,
                              params={n: ParamTarget(beyond + (t.data_ptr - min(x.data_ptr for x in pub.params.values())),
                                                     t.numel, t.element_size) for n, t in pub.params.items()})
    from p2pweights.transport import attach_engine, detach_engine

    attach_engine(s.transport, s.writer, 0, "engine0/rank0", lying)
    s.targets[0] = (0, "engine0/rank0", lying)
    with pytest.raises(UpdateFailed) as info:
        s.push(14)
    assert "NIXL could not create a write" in info.value.failures["engine0/rank0"]
    detach_engine(s.transport, s.writer, 0)
    del s.targets[0]
    s.attach(0, p)
    assert s.push(15).ok and p.check(15) == 0


def test_doctor_names_the_nixl_data_path_it_would_take(monkeypatch):
    from p2pweights.commands.doctor import _transports

    monkeypatch.setenv("P2PW_NIXL_API", "auto")
    assert _transports()["nixl"]["data_path"]["path"] == "native"
    monkeypatch.setenv("P2PW_NIXL_API", "python")
    assert _transports()["nixl"]["data_path"] == {"path": "python", "library": _transports()["nixl"]["data_path"]["library"],
                                                  "reason": "P2PW_NIXL_API=python"}


def test_bench_transport_measures_both_nixl_paths_with_a_python_loop_beside_the_writes():
    import argparse
    import io
    from contextlib import redirect_stdout

    from p2pweights.benchmarking import transport_vs_vendor as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--transport", "nixl", "--nixl-api", "both", "--size", "16MiB", "--slot-size", "4MiB",
                         "--repeat", "1", "--json"])
    out = io.StringIO()
    with redirect_stdout(out):
        assert bench.run(args) == 0
    rows = json.loads(out.getvalue())
    assert sorted((r["path"], r["mode"]) for r in rows) == [("native", "fill+write"), ("native", "write"),
                                                           ("python", "fill+write"), ("python", "write")]
    for r in rows:
        assert r["wrong_bytes"] == 0
        assert (r["python_progress"] is None) == (r["mode"] == "fill+write")
        # the loop's progress may be 0 over a 16 MiB write (the GIL test pins who holds it); the row
        # must still be measured and every byte right
        assert r["mode"] == "fill+write" or (r["python_progress"] >= 0 and r["gbps_with_python_loop"] > 0)
