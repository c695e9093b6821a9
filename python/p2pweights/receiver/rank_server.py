"""HTTP between an engine's leader (rank 0) and its other ranks.

Ranks >= 1 serve one internal route, ``POST /p2pw_rank/<verb>`` (``protocol.RANK_ROUTE_PREFIX``):
the body is the verb's arguments, the answer ``{"ok": true, "result": ...}`` or HTTP 500 with
the control plane's one error payload (``protocol.error_payload``), so a typed error raised on a
rank (its class, parameter and hint) reaches the leader, and from there the trainer, as it was.
The verbs are :meth:`EngineRank.call`'s. The leader calls them with :func:`call_rank`; every call
goes through the one control-plane client (``control.http.request``).
"""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from ..control import protocol
from ..control.http import request
from ..errors import EngineError, EngineUnreachable, P2PWeightsError
from .server import send_json

if TYPE_CHECKING:
    from .rank import EngineRank

logger = logging.getLogger(__name__)

RANK_TIMEOUT = 600.0           # leader -> rank control calls (end and the check can take a while)
CONNECT_TIMEOUT = 3.0


class _RankHandler(BaseHTTPRequestHandler):
    rank: "EngineRank"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's name
        logger.debug(format, *args)

    def do_POST(self) -> None:
        verb = self.path.removeprefix(protocol.RANK_ROUTE_PREFIX)
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            status, payload = protocol.OK, {"ok": True, "result": self.rank.call(verb, body)}
        except Exception as e:  # noqa: BLE001 - reported to the leader
            logger.exception("rank %d: %s failed", self.rank.rank, verb)
            error = e if isinstance(e, P2PWeightsError) else f"{type(e).__name__}: {e}"
            status, payload = protocol.ENGINE_FAILED, {"ok": False, **protocol.error_payload(error, rank=self.rank.rank)}
        send_json(self, status, payload)


def serve_rank_control(rank: "EngineRank", host: str, port: int) -> ThreadingHTTPServer:
    """Start rank ``rank``'s control endpoint on ``host:port`` (0: a free port), in a daemon thread."""
    handler = type("_BoundRankHandler", (_RankHandler,), {"rank": rank})
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="p2pw-rank-control",
                     daemon=True).start()
    return httpd


def call_rank(url: str, rank: int, verb: str, body: dict, timeout: float = RANK_TIMEOUT) -> Any:
    """Run ``verb`` on the rank whose control endpoint is ``url``; its result, or EngineError naming
    the rank (unreachable, or the verb failed there)."""
    try:
        status, payload = request("POST", url, protocol.RANK_ROUTE_PREFIX + verb, body=body, timeout=timeout,
                                  connect_timeout=CONNECT_TIMEOUT)
    except EngineUnreachable as e:
        raise EngineError(f"rank {rank} ({url}) is unreachable: {e.message}", rank=rank) from e
    if status != protocol.OK or not isinstance(payload, dict) or not payload.get("ok"):
        answer = protocol.ErrorAnswer.of(payload)
        raise answer.exception(f"rank {rank}: {answer.message or f'HTTP {status}'}", rank=rank)
    return payload["result"]


def get_json(url: str, path: str, timeout: float = CONNECT_TIMEOUT) -> Any:
    """``GET url+path`` answered 200: its JSON (EngineError otherwise, EngineUnreachable when down)."""
    status, payload = request("GET", url, path, timeout=timeout, connect_timeout=timeout)
    if status != protocol.OK:
        raise EngineError(f"GET {url}{path}: HTTP {status}: {str(payload)[:300]}")
    return payload
