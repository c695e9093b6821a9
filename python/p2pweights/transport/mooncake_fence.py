"""Fencing a Mooncake receiver endpoint (transport/revocation.py, docs/security.md "Epochs"): its
regions unregistered and the connections its TCP data port accepted cut, so that a request already
accepted (its address checked once, at its header) cannot keep writing after a revocation."""
from __future__ import annotations

import json
import logging
import os
import socket
import struct
import time
from typing import Any

from ..errors import TransportError

logger = logging.getLogger(__name__)

# -- the handshake port, the accepted connections, the fence ---------------------
_METADATA_REQUEST = 1  # HandShakeRequestType::Metadata (Mooncake's include/common.h)
_NOT_REGISTERED = -3   # ERR_ADDRESS_NOT_REGISTERED (include/error.h): unregister_memory of an address not registered


def segment_descriptor(session_id: str, timeout: float = 5.0) -> dict[str, Any]:
    """The segment descriptor a Mooncake engine serves on its handshake port (P2PHANDSHAKE): what a
    sender's handshake fetches (``buffers``, ``tcp_data_port``, ...). Mooncake's own framing
    (``writeString`` / ``readString``, include/common.h): a uint64 length in host order, a type byte,
    JSON. The handshake listener serves one connection at a time: ask it before a sender can hold it."""
    host, _, port = session_id.rpartition(":")
    body = bytes([_METADATA_REQUEST]) + b"{}"
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as s:
        s.sendall(struct.pack("=Q", len(body)) + body)
        data = b""
        while len(data) < 8 or len(data) < 8 + struct.unpack("=Q", data[:8])[0]:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            data += chunk
    if len(data) < 9 or len(data) < 8 + struct.unpack("=Q", data[:8])[0] or data[8] != _METADATA_REQUEST:
        raise TransportError(f"Mooncake engine {session_id} answered its handshake with {len(data)} byte(s), "
                             f"not a segment descriptor")
    return json.loads(data[9:8 + struct.unpack("=Q", data[:8])[0]])


def tcp_data_port(session_id: str, timeout: float = 5.0) -> int | None:
    """The TCP transport's data port of the engine ``session_id`` (None: it runs no TCP transport)."""
    port = int(segment_descriptor(session_id, timeout).get("tcp_data_port") or 0)
    return port or None


def _socket_inodes(port: int) -> set[int]:
    """Inodes of the connections (not listeners) whose local TCP port is ``port`` in this network namespace."""
    inodes = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.readlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] != "0A":  # 0A: LISTEN
                inodes.add(int(cols[9]))
    return inodes


def _fd_inode(fd: int) -> int | None:
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None
    return int(target[8:-1]) if target.startswith("socket:[") else None


def accepted_connections(port: int) -> dict[int, int]:
    """``{fd: socket inode}``: this process's connections accepted on TCP ``port`` (their local port)."""
    inodes = _socket_inodes(port)
    out = {}
    for name in os.listdir("/proc/self/fd"):
        inode = _fd_inode(int(name))
        if inode in inodes:
            out[int(name)] = inode
    return out


def cut_accepted(port: int, deadline: float) -> int:
    """Cuts every connection this process accepted on TCP ``port`` and waits until its owner closed it.

    Each socket is shut down (both ways) through a duplicate of its descriptor, so no descriptor
    number is touched: Mooncake's io thread then reads end-of-file, ends the session and closes the
    socket, and a request it had accepted reads nothing more into memory. This returns once every
    socket it found is closed (the count); a socket still open at ``deadline`` (``time.monotonic()``)
    raises TransportError. Connections accepted later send a header that is checked against what is
    registered then: fence the memory first (:func:`fence`)."""
    found = accepted_connections(port)
    for fd, inode in found.items():
        try:
            dup = os.dup(fd)
        except OSError:
            continue  # closed meanwhile
        try:
            if os.fstat(dup).st_ino != inode:
                continue  # the number was reused by another file meanwhile
            sock = socket.socket(fileno=dup)
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # not connected any more
            finally:
                sock.detach()
        finally:
            os.close(dup)
    pause = 1e-3
    while True:
        left = {fd for fd, inode in found.items() if _fd_inode(fd) == inode}
        if not left:
            return len(found)
        if time.monotonic() > deadline:
            raise TransportError(f"{len(left)} of the {len(found)} connection(s) accepted on TCP port {port} were "
                                 f"shut down but not closed in time (is the transfer engine's io thread stuck?)")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


def fence(engine: Any, registered: dict[int, int], data_port: int | None, session_id: str, deadline: float,
          protocol: str = "tcp") -> int:
    """Nothing lands through the Mooncake ``engine`` once this returns: every address in ``registered``
    (``{address: nbytes}``, emptied as they go) unregistered, so a later request's header is refused
    (TCP) or its memory keys fail at the NIC (RDMA), then every connection it accepted cut
    (:func:`cut_accepted`), so a request already accepted stops where it is. Idempotent: a second call
    finishes what a failed one left. Returns the connections cut; TransportError names what failed."""
    failed = []
    for addr in list(registered):
        rc = engine.unregister_memory(addr)
        if rc in (0, _NOT_REGISTERED):  # not registered (any more): what the fence is for
            registered.pop(addr)
        else:
            failed.append((addr, rc))
    if data_port is None:
        try:
            data_port = tcp_data_port(session_id, timeout=max(0.1, deadline - time.monotonic()))
        except (OSError, ValueError, TransportError) as e:
            if protocol == "tcp":
                raise TransportError(f"Mooncake engine {session_id}: its TCP data port is unknown and its handshake "
                                     f"did not say ({e}): the connections senders opened to it cannot be cut") from None
            logger.warning("Mooncake engine %s (%s): no TCP data port found (%s); its memory keys are revoked by the "
                           "unregistration", session_id, protocol, e)
    cut = cut_accepted(data_port, deadline) if data_port else 0
    if failed:
        raise TransportError(f"Mooncake engine {session_id} refused to unregister {len(failed)} region(s) "
                             f"(first at 0x{failed[0][0]:x}: {failed[0][1]})")
    return cut


