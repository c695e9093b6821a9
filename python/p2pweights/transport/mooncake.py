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
cancel a write: a released in-flight write is kept as "abandoned" and reaped later. Until every
abandoned write of a request ended, ``release`` of that request answers IN_PROGRESS ("still reading
the slot"), so the native writer does not hand the slot out again (invariant 2); and a reconnect
to the same peer waits until its abandoned writes ended (see ``connect``), so none lands after
newer ones.

Knobs (keyword, else the setting, else default; see p2pweights.settings):
  protocol  P2PW_MOONCAKE_PROTOCOL (also MOONCAKE_PROTOCOL)  rdma when an RDMA device exists, else tcp
  device    P2PW_MOONCAKE_DEVICE (also MOONCAKE_DEVICE)      "" (all devices)
  hostname  P2PW_HOSTNAME                                    127.0.0.1 without RDMA, else this host's IP
Over tcp, ``MC_TCP_LANES_PER_PEER`` (Mooncake's connections per peer) is set to 16 unless set.

Where it listens (measured with Mooncake 0.3.13, docs/security.md): the RPC/handshake port (the
session id's port) on 0.0.0.0 and the TCP data port on [::] (dual stack), whatever the hostname.
The vendor hard-codes the wildcard; ``MC_TCP_BIND_ADDRESS`` only picks the address advertised under
a metadata server (set here from the hostname), it binds nothing. ``MC_MIN_RPC_PORT`` /
``MC_MAX_RPC_PORT`` (outside 32768-60999) confine both ports to a range a firewall rule can name.

Fencing a receiver (:func:`fence`; docs/security.md, "Epochs"). Mooncake's TCP transport checks a
request's address against the registered buffers once, at its header (``ServerSession::readHeader``,
``validateTcpAddress`` in tcp_transport.cpp / tcp_transport_session_impl.h), then reads the body
straight into the destination in 64 KiB chunks (``readBody``). So ``unregister_memory`` refuses every
later request but not one already accepted: measured, a 256 MiB write whose sender was stopped after
~100 MiB landed its remaining bytes after the unregister, and the sender saw success. Only closing the
connection stops it: dropping the TransferEngine does (its io_context is stopped and destroyed with the
server sessions), and so does :func:`cut_accepted`, which needs no engine of ours (sglang keeps its own).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..errors import Busy, NotFound, RemoteDisconnected, TransportError, code_of
from ..settings import value
from .mooncake_fence import fence, tcp_data_port
from .publication import EnginePublication, ParamTarget, check_descriptor_transport, parse_descriptor

logger = logging.getLogger(__name__)

NAME = "mooncake"

TCP_LANES_PER_PEER = 16  # MC_TCP_LANES_PER_PEER unless set (see new_engine)
# the native status codes poll returns (plain ints: PyTransport reads an int)
IN_PROGRESS, DONE = code_of("IN_PROGRESS"), code_of("OK")
TIMEOUT, REMOTE_DISCONNECTED, TRANSPORT_ERROR = code_of("TIMEOUT"), code_of("REMOTE_DISCONNECTED"), code_of("TRANSPORT_ERROR")
_BAD_BATCH = {0, -1, (1 << 64) - 1}


def rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def default_hostname() -> str:
    h = value("P2PW_HOSTNAME")
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
    return value("P2PW_MOONCAKE_PROTOCOL") or ("rdma" if rdma_devices() else "tcp")


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
    if metadata_server != "P2PHANDSHAKE":  # there Mooncake advertises this, else its first LAN address
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", hostname)
    protocol = protocol or default_protocol()
    if protocol == "tcp":
        # Mooncake's TCP transport runs one request at a time per connection and waits for the
        # receiver's acknowledgement before the next: with one request per parameter (hundreds per
        # slot), 4 connections per peer leave the sockets idle between requests. 16 (Mooncake's
        # maximum) moved 128 x 2 MiB pieces 1.6x faster over loopback (benchmarks/bench_mooncake_tcp.py;
        # no change where the CPU is the bound). Read when the engine is initialized; a value set wins.
        os.environ.setdefault("MC_TCP_LANES_PER_PEER", str(TCP_LANES_PER_PEER))
    device = device if device is not None else (value("P2PW_MOONCAKE_DEVICE") or "")
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
    # batch ids given up on (after a failed piece, or released in flight) that may still read the
    # slot: release answers IN_PROGRESS until _reap saw each of them end
    abandoned: list[int] = field(default_factory=list)


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
        self._reap_lock = threading.Lock()
        self._peers: dict[int, _Peer] = {}
        self._requests: dict[int, _Request] = {}
        self._draining: dict[int, _Request] = {}  # released requests whose abandoned writes still run
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
                if not _peer_alive(peer.session):
                    error = (REMOTE_DISCONNECTED, f"Mooncake peer {peer.session} is gone (submit failed)")
                else:
                    error = (TRANSPORT_ERROR, f"Mooncake transfer_submit_write to {peer.session} failed")
                if not req.pending:
                    raise (RemoteDisconnected if error[0] == REMOTE_DISCONNECTED else TransportError)(error[1])
                # Pieces already submitted keep running and read the slot: the request is returned
                # failed, so that its release holds the slot until they ended.
                pending, req.pending = req.pending, []
                self._abandon(req, pending)
                req.error = error
                break
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
                # Pieces run in the order submitted (a few lanes per peer, each FIFO): the later ones
                # are asked from here next time. One poll costs the pieces that ended since the last
                # one, not every piece of the slot (hundreds: one per parameter that does not join
                # its neighbour), under the GIL, every 20 us - 2 ms, from each engine's writer thread.
                still = req.pending[i:]
                break
            # The rest of this request cannot succeed; its other writes are abandoned (reaped later).
            rest = still + req.pending[i + 1:] + ([bid] if rc != -1 else [])
            req.pending = []
            self._abandon(req, rest)
            if rc != -1:  # -2: Mooncake's own timeout, where one is configured
                req.error = (TIMEOUT, f"Mooncake reported a timeout writing to {req.session}")
            elif _peer_alive(req.session):
                req.error = (TRANSPORT_ERROR, f"a Mooncake write to {req.session} failed")
            else:
                req.error = (REMOTE_DISCONNECTED, f"Mooncake peer {req.session} is gone (connection lost)")
            return req.error
        req.pending = still
        return IN_PROGRESS if still else DONE

    def release(self, request: int) -> int | None:
        """None once no write of the request can read the sender's memory; IN_PROGRESS while one
        that Mooncake cannot cancel still runs (the writer asks again and keeps the slot)."""
        with self._lock:
            req = self._requests.pop(int(request), None) or self._draining.pop(int(request), None)
        if req is None:
            raise NotFound(f"unknown Mooncake request {request}")
        if req.pending:
            pending, req.pending = req.pending, []
            self._abandon(req, pending)
        if not req.abandoned:
            return None
        self._reap()
        with self._lock:
            live = {b for bids in self._abandoned.values() for b in bids}
            req.abandoned = [b for b in req.abandoned if b in live]
            if req.abandoned:
                self._draining[int(request)] = req
                return IN_PROGRESS
        return None

    def _abandon(self, req: _Request, batch_ids: list[int]) -> None:
        if batch_ids:
            req.abandoned.extend(batch_ids)
            with self._lock:
                self._abandoned.setdefault(req.session, []).extend(batch_ids)

    def _reap(self) -> None:
        """Frees abandoned writes that ended since (transfer_check_status frees them). One reaper at a
        time, and a write leaves ``_abandoned`` only once it was seen to end: ``release`` and
        ``_drain`` read "still running" from it."""
        with self._reap_lock:
            with self._lock:
                work = {session: list(bids) for session, bids in self._abandoned.items()}
            ended = set()
            for bids in work.values():
                for bid in bids:
                    if self.engine.transfer_check_status(bid) not in (0, -2):
                        ended.add(bid)
            if not ended:
                return
            with self._lock:
                for session in list(self._abandoned):
                    left = [b for b in self._abandoned[session] if b not in ended]
                    if left:
                        self._abandoned[session] = left
                    else:
                        del self._abandoned[session]

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
        self.protocol = protocol or default_protocol()
        self._registered: dict[int, int] = {}
        self._closed = False
        #: the TCP data port senders' connections reach (None: no TCP transport, or not known yet),
        #: asked now, while no sender can be holding the one-at-a-time handshake listener
        self.data_port: int | None = None
        self._handshake = metadata_server == "P2PHANDSHAKE"  # else its handshake serves no descriptor
        if self._handshake:
            try:
                self.data_port = tcp_data_port(self.session_id)
            except (OSError, ValueError, TransportError) as e:  # fence() asks again, and fails if it must
                logger.warning("Mooncake receiver %s: its TCP data port is unknown (%s)", self.session_id, e)

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

    def fence(self, deadline: float) -> int:
        """Nothing lands through this endpoint once this returns (:func:`fence`: its regions unregistered,
        the connections senders opened to it cut, a request mid-write included); it stays open until
        :meth:`close`. Returns the connections cut; TransportError when it cannot by ``deadline``
        (``time.monotonic()``); a later call finishes what a failed one left."""
        if self._closed:
            return 0
        if not self._handshake and self.protocol == "tcp":  # no descriptor to name the data port: the
            self.close()                                     # engine's destructor cuts its connections
            return 0
        return fence(self.engine, self._registered, self.data_port, self.session_id, deadline, self.protocol)

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
        # Dropping the TransferEngine stops its io thread and closes its listeners and every connection
        # senders opened to it (a request mid-write included: measured), in its destructor, which holds
        # the GIL (up to a second: its handshake listener polls accept() once a second).
        self.engine = None

    def __enter__(self) -> "MooncakeReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
