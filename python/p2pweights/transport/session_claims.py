"""Whose session an engine rank's publication claims (docs/transports.md, "Publication checks"): its
session id's host is the engine's own, and no two engine ranks claim one session. A sender checks
every rank at connect (``sender/weight_sender.py``)."""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..errors import LayoutMismatch
from .publication import EnginePublication, who_of


def _addresses(host: str) -> set[str]:
    """Every IP address ``host`` names (itself when it is one); empty when it does not resolve."""
    try:
        return {str(ipaddress.ip_address(host))}
    except ValueError:
        pass
    try:
        return {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except OSError:
        return set()


def _is_loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_loopback


def _is_local(addr: str) -> bool:
    """An address of this machine: one a socket can bind to."""
    if _is_loopback(addr):
        return True
    family = socket.AF_INET6 if ipaddress.ip_address(addr).version == 6 else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((addr, 0))
        return True
    except OSError:
        return False


def host_is_engines(session_host: str, engine_hosts: Iterable[str], is_local: Callable[[str], bool] = _is_local) -> bool:
    """True when ``session_host`` is an address of one of ``engine_hosts`` (the host in the engine's
    URL as the sender reached it, its bootstrap server's, the address the rank registered from).
    An engine reached on a loopback address runs on this machine: then any address of this machine
    is its own (sglang advertises the node's IP even when the trainer talks to it on 127.0.0.1)."""
    session = _addresses(session_host)
    if not session:
        return False
    for host in engine_hosts:
        if not host:
            continue
        addrs = _addresses(host)
        if session & addrs:
            return True
        if addrs and all(_is_loopback(a) for a in addrs) and all(is_local(a) for a in session):
            return True
    return False


@dataclass(frozen=True)
class SessionClaim:
    """One engine rank's publication as a sender reached it: the engine's name, the hosts it was
    reached at (its URL, its bootstrap server), and whether the host rule applies to it."""

    engine: str
    hosts: tuple[str, ...]
    publication: EnginePublication
    check_host: bool = True


def session_claim(engine: Any, publication: EnginePublication, server_info: Mapping[str, Any] | None = None
                  ) -> SessionClaim:
    """The claim of one engine rank's publication, from the engine's client (``name``, ``base_url``,
    ``bootstrap_url``, as ``control.SglangEngine``) and its ``/server_info``: an engine over several
    nodes (``nnodes`` > 1) has ranks that advertise their own node's address, so only the distinct
    rule applies to it."""
    from urllib.parse import urlsplit

    hosts = tuple(urlsplit(u).hostname or "" for u in (engine.base_url, getattr(engine, "bootstrap_url", None)) if u)
    nodes = int((server_info or {}).get("nnodes") or 1)
    return SessionClaim(str(engine.name), hosts, publication, check_host=nodes <= 1)


def check_sessions(claims: Sequence[SessionClaim], is_local: Callable[[str], bool] = _is_local) -> None:
    """Every engine rank's session id is its own (docs/transports.md, "Publication checks"):

    - host (Mooncake): the session id's host is the engine's host as the sender reached it (its
      URL's or bootstrap server's host; any address of this machine when that is a loopback
      address), or the address the rank registered from (``registered_from``). Not applied to an
      engine whose ``check_host`` is False (ranks spread over several nodes), to one whose hosts do
      not resolve here (a client that reaches it by other means), nor to NIXL (agent names carry no
      host).
    - distinct: no two engine ranks claim the same session id (Mooncake) or agent name (NIXL);
      an engine that published another engine's session would have the sender write into that one.

    Raises LayoutMismatch naming the engine and rank (and, for a shared session, both claimants)."""
    owners: dict[tuple[str, str], SessionClaim] = {}
    for c in claims:
        pub = c.publication
        who = who_of(c.engine, pub.rank)
        key = (pub.transport, pub.peer)
        first = owners.setdefault(key, c)
        if first is not c and (first.engine, first.publication.rank) != (c.engine, pub.rank):
            raise LayoutMismatch(
                f"{who} published session {pub.peer!r}, which {who_of(first.engine, first.publication.rank)} "
                f"published too: a session belongs to one engine rank; refusing to connect to either",
                engine=c.engine, rank=pub.rank,
                hint="an engine is serving another engine's weights table (forged, or a stale registration); "
                     "restart it, and protect the control plane with an API key")
        host = pub.session_host
        # an engine client whose host does not resolve here reaches it by other means: nothing to judge by
        if c.check_host and host and any(_addresses(h) for h in c.hosts if h):
            hosts = (*c.hosts, pub.registered_from)
            if not host_is_engines(host, hosts, is_local):
                reached = ", ".join(h for h in hosts if h)
                raise LayoutMismatch(
                    f"{who} published session {pub.peer!r}, whose host {host} is not the engine's ({reached}): "
                    f"the sender would write into another machine's memory; refusing to connect",
                    engine=c.engine, rank=pub.rank,
                    hint="reach the engine at the address its transfer engine advertises, or restart it if its "
                         "weights table was forged")
