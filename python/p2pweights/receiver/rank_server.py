"""HTTP between an engine's leader (rank 0) and its other ranks.

Ranks >= 1 serve one internal route, ``POST /p2pw_rank/<verb>`` (``routes.RANK_ROUTE_PREFIX``):
the body is the verb's arguments, the answer ``{"ok": true, "result": ...}`` or HTTP 500 with
the control plane's one error payload (``error_answers.error_payload``), so a typed error raised on a
rank (its class, parameter and hint) reaches the leader, and from there the trainer, as it was.
The verbs are :meth:`EngineRank.call`'s. The leader calls them with :func:`call_rank`; every call
goes through the one control-plane client (``control.http.request``). With an API key the endpoint
answers 401 to a call without it, and refuses bodies as the engine's server does (:mod:`.http_guard`).
"""
from __future__ import annotations

import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from ..control import error_answers, protocol, routes
from ..control.http import request
from ..errors import EngineError, EngineUnreachable, P2PWeightsError
from ..settings import value as setting
from . import http_guard
from .http_guard import send_json

if TYPE_CHECKING:
    from .rank import EngineRank

logger = logging.getLogger(__name__)

RANK_TIMEOUT = 600.0           # a client's equality check (check_weights_equal) on a whole engine
CONNECT_TIMEOUT = 3.0


def rank_timeout() -> float:
    """How long the leader waits for a rank's answer: just under ``P2PW_ENGINE_TIMEOUT``, so the
    leader names a stalled rank before the trainer's own call to the leader gives up."""
    return 0.9 * float(setting("P2PW_ENGINE_TIMEOUT"))


def ping_timeout() -> float:
    """A live rank answers ``ping`` at once (no lock, no work); one that does not within
    ``P2PW_ENGINE_CONNECT_TIMEOUT`` is stopped or wedged."""
    return float(setting("P2PW_ENGINE_CONNECT_TIMEOUT"))


class _RankHandler(BaseHTTPRequestHandler):
    rank: "EngineRank"
    api_key: str | None = None
    protocol_version = "HTTP/1.1"  # keep-alive: a client's next verb reuses the connection (control.http)
    disable_nagle_algorithm = True  # an answer's headers and body are two writes: no 40 ms delayed-ACK stall
    timeout = http_guard.READ_TIMEOUT  # every read of a request: a stalled client cannot hold a thread

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's name
        logger.debug(format, *args)

    def do_POST(self) -> None:
        verb = self.path.removeprefix(routes.RANK_ROUTE_PREFIX)
        try:
            http_guard.check_key(self, self.api_key)
            body = http_guard.read_json_object(self)
        except http_guard.RequestRefused as e:
            return send_json(self, e.status, {"ok": False, **e.payload()})
        if not self.path.startswith(routes.RANK_ROUTE_PREFIX):
            return send_json(self, protocol.NOT_FOUND, {"ok": False, **error_answers.error_payload(
                f"Not Found: {self.path[:200]}", rank=self.rank.rank)})
        t0 = time.perf_counter()
        try:
            result = self.rank.call(verb, body)
            status, payload = protocol.OK, {"ok": True, "result": result, "seconds": time.perf_counter() - t0}
        except Exception as e:  # noqa: BLE001 - reported to the leader
            # a plain KeyError is the caller's: EngineRank.call's "unknown rank verb", or a missing argument
            bad_input = isinstance(e, KeyError) and not isinstance(e, P2PWeightsError)
            if not bad_input:
                logger.exception("rank %d: %s failed", self.rank.rank, verb)
            error = e if isinstance(e, P2PWeightsError) else f"{type(e).__name__}: {e}"
            status = protocol.BAD_REQUEST if bad_input else protocol.ENGINE_FAILED
            payload = {"ok": False, **error_answers.error_payload(error, rank=self.rank.rank)}
        send_json(self, status, payload)


def serve_rank_control(rank: "EngineRank", host: str, port: int, api_key: str | None = None) -> ThreadingHTTPServer:
    """Start rank ``rank``'s control endpoint on ``host:port`` (0: a free port), in a daemon thread;
    with ``api_key``, only calls that carry it are run."""
    handler = type("_BoundRankHandler", (_RankHandler,), {"rank": rank, "api_key": api_key or None})
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="p2pw-rank-control",
                     daemon=True).start()
    return httpd


def call_rank(url: str, rank: int, verb: str, body: dict, timeout: float | None = None, *,
              api_key: str | None = None, seconds: dict | None = None) -> Any:
    """Run ``verb`` on the rank whose control endpoint is ``url``; its result, or EngineError naming
    the rank (unreachable, or the verb failed there). ``api_key``: the engine's key. ``timeout``:
    default :func:`rank_timeout`. ``seconds``: where to put ``rank`` -> the seconds the verb took
    on the rank (its own clock)."""
    try:
        status, payload = request("POST", url, routes.RANK_ROUTE_PREFIX + verb, body=body,
                                  timeout=timeout or rank_timeout(),
                                  connect_timeout=CONNECT_TIMEOUT, api_key=api_key)
    except EngineUnreachable as e:
        raise EngineError(f"rank {rank} ({url}) is unreachable: {e.message}", rank=rank) from e
    if status != protocol.OK or not isinstance(payload, dict) or not payload.get("ok"):
        answer = error_answers.ErrorAnswer.of(payload)
        raise answer.exception(f"rank {rank}: {answer.message or f'HTTP {status}'}", rank=rank)
    if seconds is not None and isinstance(payload.get("seconds"), (int, float)):
        seconds[rank] = payload["seconds"]
    return payload["result"]


def get_json(url: str, path: str, timeout: float = CONNECT_TIMEOUT, *, api_key: str | None = None) -> Any:
    """``GET url+path`` answered 200: its JSON (EngineError otherwise, EngineUnreachable when down)."""
    status, payload = request("GET", url, path, timeout=timeout, connect_timeout=timeout, api_key=api_key)
    if status != protocol.OK:
        raise EngineError(f"GET {url}{path}: HTTP {status}: {str(payload)[:300]}")
    return payload
