"""Publishing one engine rank's regions to its engine's server, from any process: the client side
of ``PUT /register_transfer_engine_info`` (a :class:`~p2pweights.receiver.ReceiverServer`, or
sglang's engine-info bootstrap server); and the leader's side of a rank's registration: the control
URL it may call the rank at (:class:`RankEndpoints`, the only place the engine's key is sent) and
the check that what was registered is what the rank process publishes (:func:`check_claim`)."""
from __future__ import annotations

import ipaddress
import socket
from typing import Any, Mapping
from urllib.parse import urlsplit

from ..control import bodies, error_answers, http, routes
from ..control import protocol as p
from ..errors import EngineUnreachable, InvalidRequest
from ..settings import value as setting


def register_transfer_engine_info(url: str, rank: int, session_id: str, weights_info: dict,
                                  timeout: float = 10.0, *, extra: dict | None = None,
                                  api_key: str | None = None) -> None:
    """Publish one rank's regions to an engine's server (a ReceiverServer, or sglang's bootstrap
    server on --engine-info-bootstrap-port): ``PUT /register_transfer_engine_info`` with sglang's body
    ``{"tp_rank", "transfer_engine_info": {"session_id", "weights_info_dict"}}``. ``extra`` keys go
    into ``transfer_engine_info`` too (a ReceiverServer publishes them; sglang ignores them).
    ``api_key`` (default ``P2PW_API_KEY``): the engine's key; without it a keyed server answers 401."""
    route = routes.route("register_transfer_engine_info")
    body = bodies.RegisterTransferEngineInfoReq(int(rank), {**(extra or {}), "session_id": session_id,
                                                        "weights_info_dict": weights_info})
    try:
        status, answer = http.request(route.method, url, route.path, body=bodies.encode(body), timeout=timeout,
                                      connect_timeout=timeout, api_key=setting("P2PW_API_KEY", api_key))
    except EngineUnreachable as e:
        raise EngineUnreachable(f"cannot register rank {rank}'s transfer-engine info: {e.message}", rank=int(rank),
                                hint=e.hint) from e
    if status != p.OK:
        said = error_answers.ErrorAnswer.of(answer)
        raise said.exception(f"registering rank {rank}'s transfer-engine info at {url} failed: "
                             f"HTTP {status}: {said.message}", rank=int(rank),
                             hint=error_answers.hint_for("register_transfer_engine_info", status, said.message) or None)


# ---- the leader's side: whose control endpoint, whose publication ---------------------------------

def control_url(host: str, port: int) -> str:
    """A rank's control endpoint as its launcher names it and the rank registers it (one formula
    for both, compared as strings)."""
    return f"http://{host}:{int(port)}"


def parse_rank_ports(text: str | None, host: str) -> dict[int, str]:
    """``--rank-ports P1,P2,...`` (rank 0's flag: the control ports the launcher gave ranks 1, 2, ...)
    -> {rank: control URL}; empty when not given."""
    if not text:
        return {}
    try:
        ports = [int(p) for p in str(text).split(",")]
    except ValueError:
        raise ValueError(f"--rank-ports takes the control ports of ranks 1, 2, ... separated by commas, "
                         f"got {text!r}") from None
    if not all(0 < p < 65536 for p in ports):
        raise ValueError(f"--rank-ports: every port must be in 1..65535, got {text!r}")
    return {r: control_url(host, p) for r, p in enumerate(ports, start=1)}


class RankEndpoints:
    """Which control URL the leader accepts for each rank, and so where it ever sends the engine's
    key. ``given``: rank -> the URL the launcher gave it (``--rank-ports``): only that one is
    accepted. Without it (ranks started by hand), a rank's first registration names its URL, which
    must be on the leader's host (``host``, or loopback); a later registration may not move it.
    Refusals are :class:`~p2pweights.errors.InvalidRequest` (HTTP 400), naming the rank and both URLs."""

    def __init__(self, given: Mapping[int, str] | None = None, host: str = "127.0.0.1", world: int | None = None):
        self.given = dict(given or {})
        self.host = host
        self.world = world  # the engine's ranks: 1 .. world - 1 register (None: not known here)
        self._first: dict[int, str] = {}

    def admit(self, rank: int, url: object) -> str:
        """The URL to call rank ``rank`` at, from what it registered; raises InvalidRequest otherwise.
        Nothing is recorded: :meth:`bind` does, once the rank confirmed its publication there."""
        rank = int(rank)
        if (self.world is not None and not 1 <= rank < self.world) or (self.given and rank not in self.given):
            raise InvalidRequest(f"rank {rank} is not a rank >= 1 of this engine's launcher "
                                 f"(ranks {', '.join(map(str, sorted(self.given))) or f'1..{(self.world or 1) - 1}'}): "
                                 f"refused", rank=rank)
        if not isinstance(url, str) or not url:
            raise InvalidRequest(f"rank {rank} registered without its control URL (p2pw_control_url)", rank=rank)
        expected = self.given.get(rank) or self._first.get(rank)
        if expected is not None:
            if url != expected:
                how = "the launcher gave it" if rank in self.given else "it first registered"
                raise InvalidRequest(
                    f"rank {rank} registered the control URL {url[:200]!r}, not {expected!r} ({how}): refused; the "
                    f"leader calls a rank only at the URL its launcher gave it", rank=rank,
                    hint="a forged registration, or a rank restarted on another port: restart the whole engine")
            return url
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if (parts.scheme != "http" or not parts.hostname or port is None or parts.path not in ("", "/")
                or parts.query or parts.username or parts.password):
            raise InvalidRequest(f"rank {rank} registered a control URL {url[:200]!r} that is not http://HOST:PORT",
                                 rank=rank)
        if not _same_host(parts.hostname, self.host):
            raise InvalidRequest(
                f"rank {rank} registered the control URL {url[:200]!r}, which is not on the leader's host "
                f"({self.host}): refused", rank=rank,
                hint="start the ranks with the leader's --host, or give the leader --rank-ports")
        return url

    def bind(self, rank: int, url: str) -> None:
        """Record ``url`` (admitted, and confirmed by the rank) as rank ``rank``'s for good."""
        if self._first.setdefault(int(rank), url) != url:
            self.admit(rank, url)  # another registration bound it first: refused, naming both


def _same_host(host: str, leader_host: str) -> bool:
    def addrs(h: str) -> set[ipaddress._BaseAddress]:
        try:
            return {ipaddress.ip_address(h.strip("[]"))}
        except ValueError:
            try:
                return {ipaddress.ip_address(i[4][0]) for i in socket.getaddrinfo(h, None)}
            except OSError:
                return set()

    mine, theirs = addrs(leader_host or "127.0.0.1"), addrs(host)
    if not theirs:
        return False
    if theirs & mine or all(a.is_loopback for a in theirs):
        return True
    return any(a.is_unspecified for a in mine)  # a leader on every address: any of this machine's


def check_claim(rank: int, info: Mapping[str, Any], own: Mapping[str, Any]) -> None:
    """What a rank registered (``info``: the ``transfer_engine_info`` of ``PUT
    /register_transfer_engine_info``) must be what the rank process itself publishes (``own``: the
    answer of its ``publication`` verb, asked at the URL the leader admitted): its session, its
    weights table and every published key, ``registered_memory`` included. Anything else is a
    forged registration (InvalidRequest naming the keys that differ)."""
    claimed = {k: v for k, v in info.items() if not str(k).startswith("p2pw_") and k != "registered_from"}
    expected = {"session_id": own.get("peer"), "weights_info_dict": own.get("table"), **dict(own.get("extra") or {})}
    differ = sorted(str(k) for k in set(claimed) | set(expected) if claimed.get(k) != expected.get(k))
    if differ:
        raise InvalidRequest(
            f"rank {int(rank)}'s registration differs from what the rank process publishes at its control URL "
            f"({', '.join(differ[:8])}): refused; the leader serves only what each rank registered itself",
            rank=int(rank), hint="a forged registration: protect the engine's key, restart the engine")
