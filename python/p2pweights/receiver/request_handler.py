"""The receiver engine's HTTP app (:func:`build_app`): a Starlette app of ``control.routes``' table
behind the HTTP front's :class:`~p2pweights.front.Guard` (the key, body limits and deadlines,
error answers), served by :class:`~p2pweights.front.BackgroundServer`.

One request's way to a verb is :meth:`RequestHandler.answer`, the one dispatch: its route, its body
decoded into the route's class, then a verb the engine core decides (``engine/core.py``,
``ReceiverServer.control``) or one only read here; then the
:class:`~.server.ReceiverServer` verb (a ``_do_<verb>`` method here); the answer is sglang's status
and body, or the control plane's one error payload (:func:`p2pweights.front.answer_for`). It runs
on a worker thread (:class:`~p2pweights.front.Workers`): hooks block for seconds while they fan a
verb out to the ranks, and the server's locks are threading locks. The verbs raise
:class:`OutOfOrder` (a call out of order: 400, as sglang answers) and :class:`Refused` (sglang's
status and message for a refused call).
"""
from __future__ import annotations

import json
import logging
import time
import traceback
from typing import Any

from ..control import bodies, error_answers, routes
from ..control import protocol as p
from ..engine import core as engine_core
from ..errors import InvalidRequest, P2PWeightsError
from ..front import Guard, StatusError, Workers, answer_for, asgi
from ..front import guard as front_guard
from . import build_report, phases

logger = logging.getLogger(__name__)


class OutOfOrder(StatusError):
    """An out-of-order control call (answered 400 like sglang, with its success/message body)."""


class Refused(StatusError):
    """A call the engine refuses with sglang's status and message (400 unless said otherwise)."""

    def __init__(self, message: str, status: int = p.BAD_REQUEST, **fields: Any):
        super().__init__(message, status, **fields)


def error_answer(e: BaseException, message: str) -> dict:
    """The error payload of a hook's exception, with sglang's message for the route."""
    fields = e.fields() if isinstance(e, P2PWeightsError) else {}
    return error_answers.error_payload(message, type_name=type(e).__name__ if isinstance(e, P2PWeightsError) else None,
                                       **fields)


def body_limit(receiver: Any, path: str) -> int:
    """The most bytes a body to ``path`` may have: the server's limit for the routes whose bodies can
    be large (``bodies.Body.LARGE``), 1 MiB for a verb's few arguments, and a route that takes no
    body (health among them; an unknown path) reads what it is sent only up to 64 KiB, unparsed."""
    route = routes.BY_PATH.get(path)
    if route is None or route.body is None:
        return front_guard.UNREAD_BODY_LIMIT
    return receiver.max_body if route.body.LARGE else min(receiver.max_body, bodies.SMALL_BODY_BYTES)


def build_app(receiver: Any) -> Guard:
    """The receiver's ASGI app: one Starlette route per path of ``control.routes``, behind the Guard."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    workers = Workers(keyed=receiver.max_connections, name="p2pw-receiver-verb")

    async def endpoint(request: Request) -> Response:
        scope = request.scope
        handler = RequestHandler(receiver, asgi.Headers(scope), asgi.client_host(scope))
        raw = await request.body()
        query = dict(request.query_params)
        status, data = await workers.run(scope, handler.answer_bytes, routes.BY_PATH[asgi.route_path(scope)], raw, query)
        return Response(data, status, media_type="application/json")

    def json_error(status: int, payload: Any, headers: dict | None = None) -> Response:
        return Response(asgi.encode(payload), status, headers=headers, media_type="application/json")

    async def not_found(request: Request, exc: HTTPException) -> Response:
        return json_error(p.NOT_FOUND, error_answers.error_payload(f"Not Found: {request.url.path[:200]}"))

    async def not_allowed(request: Request, exc: HTTPException) -> Response:
        route = routes.BY_PATH.get(asgi.route_path(request.scope))
        takes = " or ".join(route.methods) if route is not None else "other methods"
        return json_error(p.METHOD_NOT_ALLOWED, error_answers.error_payload(
            f"Method Not Allowed: {request.url.path[:200]} takes {takes}"), headers=exc.headers)

    async def failed(request: Request, exc: Exception) -> Response:  # a bug outside the dispatch's own answers
        logger.error("receiver: %s failed:\n%s", request.url.path, traceback.format_exc())
        return json_error(*answer_for(exc, asgi.route_path(request.scope)))

    app = Starlette(routes=[Route(r.path, endpoint, methods=list(r.methods)) for r in routes.ROUTES],
                    exception_handlers={p.NOT_FOUND: not_found, p.METHOD_NOT_ALLOWED: not_allowed, Exception: failed})
    app.state.workers = workers
    return Guard(app, api_key=lambda: receiver.api_key, open_paths=routes.HEALTH_PATHS,
                 body_limit=lambda path: body_limit(receiver, path), read_timeout=receiver.read_timeout,
                 body_deadline=receiver.request_deadline)


class RequestHandler:
    """One request to the receiver: its headers and client address, and one method per verb."""

    def __init__(self, receiver: Any, headers: Any, client: str):
        self.receiver, self.headers, self.client = receiver, headers, client

    def answer(self, route: routes.Route, raw: bytes, query: dict) -> tuple[int, Any]:
        """THE dispatch: ``route``'s body parsed once and checked against its class, then the engine
        core's verb or the read; (status, answer) whatever happens (an exception is answered by ``answer_for``)."""
        t0, times = time.perf_counter(), {}
        token = phases.collect(times)
        try:
            body = front_guard.json_object(raw) if route.body is not None else None
            req = bodies.decode(route.body, body) if route.body is not None else None
            if route.verb in engine_core.VERBS:  # the engine core decides (engine/core.py)
                status, payload = self.receiver.control(route.verb, self.headers, body)
                if isinstance(payload, dict) and p.ok(status):
                    payload = {**payload, p.TIMINGS_KEY: {"server_s": time.perf_counter() - t0, **times}}
            else:
                status, payload = getattr(self, "_do_" + route.verb)(req, query)
        except Exception as e:  # noqa: BLE001 - every failure is an answer; the server keeps serving
            status, payload = answer_for(e, route.path)
            if status >= p.ENGINE_FAILED:
                logger.error("receiver hook for %s failed:\n%s", route.path, traceback.format_exc())
        finally:
            phases.stop(token)
        return status, payload

    def answer_bytes(self, route: routes.Route, raw: bytes, query: dict) -> tuple[int, bytes]:
        """:meth:`answer` with its answer as JSON bytes (none for ``None``: sglang's empty body), encoded
        on the worker thread (a weights answer can be large)."""
        status, payload = self.answer(route, raw, query)
        return status, b"" if payload is None else json.dumps(payload).encode()

    # ---- one method per verb: (request body, query) -> (status, answer) ---------------------

    def _do_health(self, req: None, query: dict) -> tuple[int, Any]:
        return p.OK, self.receiver.session.health()  # None (sglang's empty body) unless updating or torn

    def _do_server_info(self, req: None, query: dict) -> tuple[int, Any]:
        # the engine's build first (sglang version, each rank's GPU architecture): the hook may say otherwise
        return p.OK, {**build_report.server_identity(self.receiver.registered_extras()), **self.receiver.hooks.server_info(),
                      "p2pw_weight_update": self.receiver.core.state()}

    def _do_model_info(self, req: None, query: dict) -> tuple[int, Any]:
        return p.OK, self.receiver._model_info()

    def _do_remote_instance_transfer_engine_info(self, req: None, query: dict) -> tuple[int, Any]:
        rank = _rank(query)  # sglang answers 400 for both a bad rank and a rank with nothing published
        info, extra = self.receiver._transfer_engine_info(rank)
        if info is None:
            raise Refused(f"Failed to get transfer engine info for rank {rank}", rank=rank)
        return p.OK, bodies.encode(bodies.TransferEngineInfo(rank, info, extra))

    def _do_get_transfer_engine_info(self, req: None, query: dict) -> tuple[int, Any]:
        rank = _rank(query)
        info, extra = self.receiver._transfer_engine_info(rank)
        if info is None:  # the bootstrap server's answer
            raise Refused(f"No transfer engine info for rank {rank}", p.NOT_FOUND, rank=rank)
        return p.OK, bodies.encode(bodies.TransferEngineInfo(rank, info, extra))

    def _do_register_transfer_engine_info(self, req: bodies.RegisterTransferEngineInfoReq, query: dict) -> tuple[int, Any]:
        info = req.transfer_engine_info
        extra = {k: v for k, v in info.items() if k not in ("session_id", "weights_info_dict")}
        extra["registered_from"] = self.client  # the server's word, not the registrant's: senders check it
        self.receiver.register_transfer_engine_info(req.tp_rank, info["session_id"], info["weights_info_dict"], extra)
        return p.OK, "OK"

    def _do_weights_checker(self, req: bodies.CheckWeightsReq, query: dict) -> tuple[int, Any]:
        return self.receiver._weights_checker(req)

    def _do_get_weights_by_name(self, req: bodies.GetWeightsByNameReq, query: dict) -> tuple[int, Any]:
        return self.receiver._get_weights_by_name(req)

    def _do_p2pw_weights_digest(self, req: bodies.WeightsDigestReq, query: dict) -> tuple[int, Any]:
        return self.receiver._weights_digest(req)



def _rank(query: dict) -> int:
    try:
        rank = int(query["rank"])
    except (KeyError, ValueError):
        raise InvalidRequest("query parameter 'rank' must be an integer >= 0") from None
    if rank < 0:
        raise InvalidRequest(f"query parameter 'rank' must be an integer >= 0, got {rank}")
    return rank
