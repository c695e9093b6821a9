"""HTTP between an engine's leader (rank 0) and its other ranks.

Ranks >= 1 serve one internal route, ``POST /p2pw_rank/<verb>`` (``routes.RANK_ROUTE_PREFIX``):
the body is the verb's arguments, the answer ``{"ok": true, "result": ...}`` or an error status
with ``"ok": false`` and the control plane's one error payload (``error_answers.error_payload``,
status by ``front.answer_for``), so a typed error raised on a rank (its class, parameter and hint)
reaches the leader, and from there the trainer, as it was. The verbs are :meth:`EngineRank.call`'s;
each one's body is checked against its class in ``bodies.RANK_BODIES`` before it runs (a wrong
type is a 400 naming the field, as is a parameter the rank does not hold). The leader calls them
with :class:`RankCall` (sent now, answered later: it sends a verb to every rank before it waits for
any; :func:`call_rank` in one step); every call goes through the one control-plane client
(``control.http``). A call may ask the rank to acknowledge it at once (``Expect: 100-continue``:
the rank's server answers ``100 Continue`` as it starts reading the body, before the verb runs),
so that a stopped rank is found within the ping's time in the verb's own round trip; a session
verb whose caller gave it up before the rank read it (the leader closed the connection:
``front.asgi.client_left``) is not run. The endpoint is a Starlette app behind the same HTTP
front as the engine's server (``p2pweights.front``: the key, 401 without it; body limits and
deadlines; verbs on worker threads), served by uvicorn on a background thread.

The other way round, a rank >= 1 watches its leader (:class:`LeaderWatch`) and exits once the
leader is gone or was replaced; "gone" is decided by the kernel, not by the leader's Python: a
leader too busy to answer (its GIL held for seconds, a long parse) still accepts connections on its
listening socket, and only a leader whose socket is closed (its process exited) or that answers as
another instance counts as a miss.
"""
from __future__ import annotations

import json
import logging
import socket
import time
import traceback
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ..control import bodies, error_answers, protocol, routes
from ..control.http import request, send
from ..errors import EngineError, EngineUnreachable, P2PWeightsError
from ..front import BackgroundServer, Guard, StatusError, Workers, answer_for, asgi
from ..front.guard import json_object
from ..settings import value as setting

if TYPE_CHECKING:
    from .rank import EngineRank

logger = logging.getLogger(__name__)

#: the rank verbs that change the weights or their post-processing: not run once the leader gave the call up
SESSION_VERBS = frozenset({"begin", "end", "apply_deltas"})
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


def run_verb(rank: "EngineRank", verb: str, raw: bytes) -> tuple[int, bytes]:
    """One call of ``verb`` on ``rank`` (its body ``raw``), answered: (status, JSON bytes). Runs on
    a worker thread. A plain KeyError (``EngineRank.call``'s "unknown rank verb", a missing argument)
    is the caller's: 400."""
    t0 = time.perf_counter()
    try:
        body = json_object(raw)
        if verb in bodies.RANK_BODIES:  # the verb's body checked before it runs (unknown verbs: call's KeyError)
            bodies.decode(bodies.RANK_BODIES[verb], body)
        try:
            result = rank.call(verb, body)
        except KeyError as e:
            if isinstance(e, P2PWeightsError):
                raise
            raise StatusError(f"KeyError: {e}") from e
        status, payload = protocol.OK, {"ok": True, "result": result, "seconds": time.perf_counter() - t0}
    except Exception as e:  # noqa: BLE001 - reported to the leader, who names the rank
        status, error = answer_for(e, None, rank=rank.rank)
        if status >= protocol.ENGINE_FAILED:
            logger.error("rank %d: %s failed:\n%s", rank.rank, verb, traceback.format_exc())
        payload = {"ok": False, **error}
    return status, json.dumps(payload).encode()


def rank_app(rank: "EngineRank", api_key: str | None = None) -> Guard:
    """Rank ``rank``'s internal endpoint as an ASGI app: one route, ``POST /p2pw_rank/<verb>``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    workers = Workers(name=f"p2pw-rank{rank.rank}-verb")

    def answer(status: int, payload: dict, **headers: str) -> Response:
        return Response(json.dumps(payload).encode(), status, headers=headers, media_type="application/json")

    async def endpoint(request: Request) -> Response:
        verb = request.path_params["verb"]
        raw = await request.body()
        if verb in SESSION_VERBS and asgi.client_left(request.scope):  # the leader gave this call up: not run
            logger.warning("rank %d: %s not run: the leader gave the call up (this rank answered too late)",
                           rank.rank, verb)
            return answer(protocol.BAD_REQUEST, {"ok": False, **error_answers.error_payload(
                f"{verb} not run: its caller gave the call up", rank=rank.rank)}, Connection="close")
        status, data = await workers.run(request.scope, run_verb, rank, verb, raw)
        return Response(data, status, media_type="application/json")

    async def refused(request: Request, exc: Any) -> Response:  # another path (404), or not a POST (405)
        status = getattr(exc, "status_code", protocol.NOT_FOUND)
        return answer(status, {"ok": False, **error_answers.error_payload(
            f"{'Not Found' if status == protocol.NOT_FOUND else 'Method Not Allowed'}: {request.url.path[:200]}",
            rank=rank.rank)})

    async def failed(request: Request, exc: Exception) -> Response:
        logger.error("rank %d: %s failed:\n%s", rank.rank, request.url.path, traceback.format_exc())
        status, error = answer_for(exc, None, rank=rank.rank)
        return answer(status, {"ok": False, **error})

    app = Starlette(routes=[Route(routes.RANK_ROUTE_PREFIX + "{verb:path}", endpoint, methods=["POST"])],
                    exception_handlers={protocol.NOT_FOUND: refused, protocol.METHOD_NOT_ALLOWED: refused,
                                        Exception: failed})
    return Guard(app, api_key=api_key or None)


class RankEndpoint(BackgroundServer):
    """A rank's endpoint, served (:class:`~p2pweights.front.BackgroundServer`); ``server_address``,
    ``shutdown()`` and ``server_close()`` are the names of the stdlib server it replaced."""

    @property
    def server_address(self) -> tuple[str, int]:
        return self.host, self.port

    def shutdown(self) -> None:
        self.close()

    def server_close(self) -> None:
        self.close()


def serve_rank_control(rank: "EngineRank", host: str, port: int, api_key: str | None = None) -> RankEndpoint:
    """Start rank ``rank``'s control endpoint on ``host:port`` (0: a free port), on a background
    thread; with ``api_key``, only calls that carry it are run. ``.close()`` stops it."""
    return RankEndpoint(rank_app(rank, api_key), host, port, name=f"p2pw-rank{rank.rank}-control").start()


def call_rank(url: str, rank: int, verb: str, body: dict, timeout: float | None = None, *,
              api_key: str | None = None, seconds: dict | None = None) -> Any:
    """Run ``verb`` on the rank whose control endpoint is ``url``; its result, or EngineError naming
    the rank (unreachable, or the verb failed there). ``api_key``: the engine's key. ``timeout``:
    default :func:`rank_timeout`. ``seconds``: where to put ``rank`` -> the seconds the verb took
    on the rank (its own clock)."""
    return RankCall(url, rank, verb, body, timeout, api_key=api_key).result(seconds)


class RankCall:
    """One verb sent to one rank now, its answer read later (:meth:`result`): a leader sends a verb
    to every rank before it runs its own part or waits for any answer. ``acknowledge``: the rank
    is asked to say at once that it took the call (``Expect: 100-continue``, answered by its
    handler thread before the verb runs), so the leader learns within seconds that a rank is
    stopped or wedged (:meth:`acknowledged`) in the same round trip as the verb, not by a ping first."""

    def __init__(self, url: str, rank: int, verb: str, body: dict, timeout: float | None = None, *,
                 api_key: str | None = None, acknowledge: bool = False):
        self.url, self.rank, self.verb = url, rank, verb
        self.timeout = timeout or rank_timeout()
        self.sent_at = time.monotonic()
        self._pending = None
        self._error: BaseException | None = None
        try:
            self._pending = send("POST", url, routes.RANK_ROUTE_PREFIX + verb, body=body, timeout=self.timeout,
                                 connect_timeout=CONNECT_TIMEOUT, api_key=api_key,
                                 headers={"Expect": "100-continue"} if acknowledge else None)
        except EngineUnreachable as e:
            self._error = EngineError(f"rank {rank} ({url}) is unreachable: {e.message}", rank=rank)
            self._error.__cause__ = e

    def acknowledged(self, within: float) -> bool:
        """Whether the rank took the call (or answered, or failed) within ``within`` seconds."""
        return self._pending is None or self._pending.acknowledged(within)

    def abandon(self, why: str) -> None:
        """Give the call up (``why``: the error :meth:`result` raises): the connection is closed, so a
        rank that reads the call later sees its caller gone and does not run it (:func:`caller_left`)."""
        if self._pending is not None:
            self._pending.abandon()
            self._pending = None
        self._error = EngineError(why, rank=self.rank)

    def result(self, seconds: dict | None = None) -> Any:
        """The verb's result; EngineError naming the rank otherwise. The wait is bounded by the call's
        timeout from when it was sent. ``seconds``: as :func:`call_rank`'s."""
        if self._error is not None:
            raise self._error
        left = self.timeout - (time.monotonic() - self.sent_at)
        try:
            status, payload = self._pending.answer(timeout=max(left, 1e-3))
        except EngineUnreachable as e:
            raise EngineError(f"rank {self.rank} ({self.url}) is unreachable: {e.message}", rank=self.rank) from e
        if status != protocol.OK or not isinstance(payload, dict) or not payload.get("ok"):
            answer = error_answers.ErrorAnswer.of(payload)
            raise answer.exception(f"rank {self.rank}: {answer.message or f'HTTP {status}'}", rank=self.rank)
        if seconds is not None and isinstance(payload.get("seconds"), (int, float)):
            seconds[self.rank] = payload["seconds"]
        return payload["result"]


def get_json(url: str, path: str, timeout: float = CONNECT_TIMEOUT, *, api_key: str | None = None) -> Any:
    """``GET url+path`` answered 200: its JSON (EngineError otherwise, EngineUnreachable when down)."""
    status, payload = request("GET", url, path, timeout=timeout, connect_timeout=timeout, api_key=api_key)
    if status != protocol.OK:
        raise EngineError(f"GET {url}{path}: HTTP {status}: {str(payload)[:300]}")
    return payload


class LeaderWatch:
    """How a rank >= 1 tells that its leader (``leader``, the engine's URL; ``instance``, the
    ``p2pw_instance`` it registered with) is gone: :meth:`check` is False only when the leader's
    port refuses connections (its process exited and the kernel closed the socket) or the server
    there answers as another instance (replaced). A leader that does not answer ``/server_info``
    within ``answer_timeout`` but whose port still accepts a TCP connection is alive and busy: the
    kernel completes the handshake on a listening socket without the process, so neither a held GIL
    nor a long request makes the leader look dead; nor does a 503 (a server too busy to take the call).
    Any other answer is not this leader's (a miss)."""

    def __init__(self, leader: str, instance: str, api_key: str | None = None, *, answer_timeout: float = 2.0,
                 connect_timeout: float = CONNECT_TIMEOUT):
        self.leader, self.instance, self.api_key = leader, instance, api_key
        self.answer_timeout, self.connect_timeout = answer_timeout, connect_timeout
        parts = urlsplit(leader if "://" in leader else "http://" + leader)
        self._address = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.busy = 0  # checks answered by the kernel alone (the leader alive, too busy to answer)

    def check(self) -> bool:
        try:
            status, payload = request("GET", self.leader, routes.route("server_info").path, timeout=self.answer_timeout,
                                      connect_timeout=self.connect_timeout, api_key=self.api_key)
        except EngineUnreachable:
            alive = self.listening()
            self.busy += alive
            return alive
        if status == protocol.SERVICE_UNAVAILABLE:  # a server too busy to take the call: alive
            return True
        return status == protocol.OK and isinstance(payload, dict) and payload.get("p2pw_instance") == self.instance

    def listening(self) -> bool:
        """Whether the leader's port accepts a TCP connection (the kernel's answer, not the leader's)."""
        try:
            with socket.create_connection(self._address, timeout=self.connect_timeout):
                return True
        except OSError:
            return False
