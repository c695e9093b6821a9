"""Mooncake Transfer Engine, driven through its Python bindings (``mooncake.engine``).

Sender side: :class:`MooncakeBackend` implements the backend protocol that the native
``PyTransport`` calls from the writer's per-engine threads (holding the GIL only per call).
Receiver side: :class:`MooncakeReceiver` registers an engine rank's memory and publishes it in
sglang's format.

Non-blocking only. Mooncake's Python API has no non-blocking status for a multi-write batch
(``get_batch_transfer_status`` spins until the batch ends, and ``transfer_check_status`` looks at
the first write of a batch only), so one posted batch of ours is a set of Mooncake single-write
batches (``transfer_submit_write``), after merging writes that are contiguous on both sides, and
``poll`` asks each unfinished one with ``transfer_check_status`` (never blocks). Mooncake cannot
cancel a write: a released in-flight write is kept as "abandoned" and reaped later, and a
reconnect to the same peer waits until its abandoned writes ended (see ``connect``).

Knobs (keyword, else environment, else default):
  protocol  P2PW_MOONCAKE_PROTOCOL (also MOONCAKE_PROTOCOL)  rdma when an RDMA device exists, else tcp
  device    P2PW_MOONCAKE_DEVICE (also MOONCAKE_DEVICE)      "" (all devices)
  hostname  P2PW_HOSTNAME                                    127.0.0.1 without RDMA, else this host's IP
"""
from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from ..errors import Busy, NotFound, RemoteDisconnected, TransportError
from .publication import EnginePublication, ParamTarget, check_descriptor_transport, parse_descriptor

NAME = "mooncake"

IN_PROGRESS, DONE = 1, 0
TIMEOUT, REMOTE_DISCONNECTED, TRANSPORT_ERROR = -2, -3, -4
_BAD_BATCH = {0, -1, (1 << 64) - 1}


def rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def _env(*names: str) -> str | None:
    for n in names:
        v = os.environ.get(n)
        if v:
            return v
    return None


def default_hostname() -> str:
    h = _env("P2PW_HOSTNAME")
    if h:
        return h
    if not rdma_devices():
        return "127.0.0.1"
    try:  # the address of the interface that routes outward; no packet is sent
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def default_protocol() -> str:
    return _env("P2PW_MOONCAKE_PROTOCOL", "MOONCAKE_PROTOCOL") or ("rdma" if rdma_devices() else "tcp")


def new_engine(hostname: str | None = None, protocol: str | None = None, device: str | None = None,
               metadata_server: str = "P2PHANDSHAKE"):
    """An initialized ``mooncake.engine.TransferEngine`` and its session id ``"ip:rpc_port"``."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise TransportError("Mooncake is not installed: pip install mooncake-transfer-engine (GPU) or "
                             "mooncake-transfer-engine-non-cuda (CPU); it also needs libibverbs1 "
                             f"(apt-get install -y libibverbs1). Import error: {e}") from None
    hostname = hostname or default_hostname()
    protocol = protocol or default_protocol()
    device = device if device is not None else (_env("P2PW_MOONCAKE_DEVICE", "MOONCAKE_DEVICE") or "")
    te = TransferEngine()
    rc = te.initialize(hostname, metadata_server, protocol, device)
    if rc != 0:
        raise TransportError(f"Mooncake TransferEngine.initialize({hostname!r}, {metadata_server!r}, {protocol!r}, "
                             f"{device!r}) returned {rc}")
    return te, f"{hostname}:{te.get_rpc_port()}"


def coalesce(local: list[int], remote: list[int], lengths: list[int]) -> list[tuple[int, int, int]]:
    """Writes contiguous on both sides become one, in the order given."""
    out: list[list[int]] = []
    for lo, re, n in zip(local, remote, lengths):
        if out and out[-1][0] + out[-1][2] == lo and out[-1][1] + out[-1][2] == re:
            out[-1][2] += n
        else:
            out.append([lo, re, n])
    return [(a, b, c) for a, b, c in out]


def _peer_alive(session: str, timeout: float = 0.3) -> bool:
    host, _, port = session.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class _Request:
    engine: int
    session: str
    pending: list[int]                 # Mooncake batch ids not yet finished
    error: tuple[int, str] | None = None
    bytes: int = 0


@dataclass
class _Peer:
    session: str


class MooncakeBackend:
    """The sender's Mooncake backend (the protocol ``_native.PyTransport`` calls)."""

    name = NAME

    def __init__(self, *, hostname: str | None = None, protocol: str | None = None, device: str | None = None,
                 metadata_server: str = "P2PHANDSHAKE", reconnect_drain_timeout: float = 5.0):
        self.engine, self.session_id = new_engine(hostname, protocol, device, metadata_server)
        self.protocol = protocol or default_protocol()
        self._lock = threading.Lock()
        self._peers: dict[int, _Peer] = {}
        self._requests: dict[int, _Request] = {}
        self._abandoned: dict[str, list[int]] = {}  # session -> batch ids released in flight
        self._registered: dict[int, int] = {}
        self._next = 1
        self._drain_timeout = reconnect_drain_timeout
        self._closed = False

    # -- memory ----------------------------------------------------------------------------------
    def register_memory(self, addr: int, length: int, location: str = "cpu") -> None:
        rc = self.engine.register_memory(int(addr), int(length), "*")
        if rc != 0:
            raise TransportError(f"Mooncake register_memory(0x{addr:x}, {length}) returned {rc}")
        self._registered[int(addr)] = int(length)

    def deregister_memory(self, addr: int) -> None:
        if int(addr) not in self._registered:
            raise NotFound(f"0x{int(addr):x} is not registered with Mooncake")
        rc = self.engine.unregister_memory(int(addr))
        self._registered.pop(int(addr), None)
        if rc != 0:
            raise TransportError(f"Mooncake unregister_memory(0x{addr:x}) returned {rc}")

    # -- peers -----------------------------------------------------------------------------------
    def connect(self, engine: int, descriptor: str) -> None:
        desc = parse_descriptor(descriptor)
        check_descriptor_transport(desc, NAME)
        self._drain(desc.peer)
        # Opens the segment (the P2P handshake fetches the peer's registered buffers) now, not on
        # the first write, so an unreachable peer fails here.
        first = self.engine.get_first_buffer_address(desc.peer)
        if not first:
            raise RemoteDisconnected(f"Mooncake peer {desc.peer} is unreachable or registered no memory")
        with self._lock:
            self._peers[int(engine)] = _Peer(desc.peer)

    def disconnect(self, engine: int) -> None:
        with self._lock:
            self._peers.pop(int(engine), None)

    def _drain(self, session: str) -> None:
        """Waits (bounded) until writes abandoned to ``session`` ended, so none lands after new ones."""
        deadline = time.monotonic() + self._drain_timeout
        sleep = 1e-3
        while True:
            self._reap()
            with self._lock:
                left = len(self._abandoned.get(session, ()))
            if not left:
                return
            if time.monotonic() > deadline:
                raise Busy(f"{left} write(s) to Mooncake peer {session} released after the transfer timeout are still "
                           f"in flight (Mooncake cannot cancel them); reconnect once the engine is responsive again, "
                           f"or restart it")
            time.sleep(sleep)
            sleep = min(sleep * 2, 0.05)

    # -- writes ----------------------------------------------------------------------------------
    def post(self, engine: int, local: list[int], remote: list[int], lengths: list[int]) -> int:
        with self._lock:
            peer = self._peers.get(int(engine))
            rid = self._next
            self._next += 1
        if peer is None:
            raise NotFound(f"engine {engine} is not connected")
        self._reap()
        req = _Request(int(engine), peer.session, [])
        for lo, re, n in coalesce(local, remote, lengths):
            bid = self.engine.transfer_submit_write(peer.session, lo, re, n)
            if bid in _BAD_BATCH or bid < 0:
                # Writes already submitted keep running; abandon them (reaped later).
                self._abandon(peer.session, req.pending)
                if not _peer_alive(peer.session):
                    raise RemoteDisconnected(f"Mooncake peer {peer.session} is gone (submit failed)")
                raise TransportError(f"Mooncake transfer_submit_write to {peer.session} failed")
            req.pending.append(bid)
            req.bytes += n
        with self._lock:
            self._requests[rid] = req
        return rid

    def poll(self, request: int) -> int | tuple[int, str]:
        with self._lock:
            req = self._requests.get(int(request))
        if req is None:
            raise NotFound(f"unknown Mooncake request {request}")
        if req.error:
            return req.error
        still = []
        for i, bid in enumerate(req.pending):
            rc = self.engine.transfer_check_status(bid)  # frees the batch on 1 (done) and -1 (failed)
            if rc == 1:
                continue
            if rc == 0:
                still.append(bid)
                continue
            # The rest of this request cannot succeed; its other writes are abandoned (reaped later).
            rest = still + req.pending[i + 1:] + ([bid] if rc != -1 else [])
            self._abandon(req.session, rest)
            req.pending = []
            if rc != -1:  # -2: Mooncake's own timeout, where one is configured
                req.error = (TIMEOUT, f"Mooncake reported a timeout writing to {req.session}")
            elif _peer_alive(req.session):
                req.error = (TRANSPORT_ERROR, f"a Mooncake write to {req.session} failed")
            else:
                req.error = (REMOTE_DISCONNECTED, f"Mooncake peer {req.session} is gone (connection lost)")
            return req.error
        req.pending = still
        return IN_PROGRESS if still else DONE

    def release(self, request: int) -> None:
        with self._lock:
            req = self._requests.pop(int(request), None)
        if req is None:
            raise NotFound(f"unknown Mooncake request {request}")
        if req.pending:
            self._abandon(req.session, req.pending)

    def _abandon(self, session: str, batch_ids: list[int]) -> None:
        if batch_ids:
            with self._lock:
                self._abandoned.setdefault(session, []).extend(batch_ids)

    def _reap(self) -> None:
        """Frees abandoned writes that ended since (transfer_check_status frees them)."""
        with self._lock:
            if not self._abandoned:
                return
            work, self._abandoned = self._abandoned, {}
        keep: dict[str, list[int]] = {}
        for session, bids in work.items():
            for bid in bids:
                if self.engine.transfer_check_status(bid) in (0, -2):
                    keep.setdefault(session, []).append(bid)
        with self._lock:
            for session, bids in keep.items():
                self._abandoned.setdefault(session, []).extend(bids)

    def abandoned_writes(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._abandoned.values())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._reap()
        for addr in list(self._registered):
            try:
                self.engine.unregister_memory(addr)
            except Exception:  # best effort
                pass
        self._registered.clear()
        # The TransferEngine object is dropped with this backend (its destructor closes the
        # segments); writes abandoned in flight may still read the sender's memory until then.


class MooncakeReceiver:
    """An engine rank's Mooncake endpoint: register its memory, publish it in sglang's format."""

    name = NAME

    def __init__(self, *, hostname: str | None = None, protocol: str | None = None, device: str | None = None,
                 metadata_server: str = "P2PHANDSHAKE"):
        self.engine, self.session_id = new_engine(hostname, protocol, device, metadata_server)
        self._registered: dict[int, int] = {}
        self._closed = False

    @property
    def peer(self) -> str:
        return self.session_id

    def register(self, addr: int, length: int, location: str = "cpu") -> None:
        rc = self.engine.register_memory(int(addr), int(length), "*")
        if rc != 0:
            raise TransportError(f"Mooncake register_memory(0x{addr:x}, {length}) returned {rc}")
        self._registered[int(addr)] = int(length)

    def deregister(self, addr: int) -> None:
        rc = self.engine.unregister_memory(int(addr))
        self._registered.pop(int(addr), None)
        if rc != 0:
            raise TransportError(f"Mooncake unregister_memory(0x{addr:x}) returned {rc}")

    def publication(self, params: dict[str, Any], rank: int | None = 0) -> EnginePublication:
        """params: ``{name: [data_ptr, numel, element_size]}`` (see publication.params_table)."""
        table = {n: ParamTarget(*(int(x) for x in row)) for n, row in params.items()}
        return EnginePublication(transport=NAME, peer=self.session_id, params=table, rank=rank)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for addr in list(self._registered):
            try:
                self.engine.unregister_memory(addr)
            except Exception:
                pass
        self._registered.clear()

    def __enter__(self) -> "MooncakeReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
