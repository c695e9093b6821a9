"""One HTTP request to a receiver engine's server (:class:`RequestHandler`): the guard's checks
(:mod:`.http_guard`: key, body size and shape), its route in ``control.routes``' table, its body
decoded into the route's class, the session gate (:func:`.session_keeper.gated`), then the
:class:`~.server.ReceiverServer` verb; the answer is sglang's status and body, or the control
plane's one error payload. The verbs raise :class:`OutOfOrder` (a call out of order: 400, as
sglang answers) and :class:`Refused` (sglang's status and message for a refused call).
"""
from __future__ import annotations

import logging
import time
import traceback
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..control import bodies, error_answers, routes
from ..control import protocol as p
from ..errors import InvalidRequest, P2PWeightsError, SessionConflict, TornWeights, UnknownParameter
from . import build_report, http_guard, phases
from . import session_keeper as sessions
from .http_guard import send_json

logger = logging.getLogger(__name__)


class OutOfOrder(Exception):
    """An out-of-order control call (answered 400 like sglang, with its success/message body)."""


class Refused(Exception):
    """A call the engine refuses with sglang's status and message (400 unless said otherwise)."""

    def __init__(self, message: str, status: int = p.BAD_REQUEST, **fields: Any):
        super().__init__(message)
        self.status, self.fields = status, fields


def error_answer(e: BaseException, message: str) -> dict:
    """The error payload of a hook's exception, with sglang's message for the route."""
    fields = e.fields() if isinstance(e, P2PWeightsError) else {}
    return error_answers.error_payload(message, type_name=type(e).__name__ if isinstance(e, P2PWeightsError) else None,
                           **fields)


class RequestHandler(http_guard.GuardedHandler):
    """Keep-alive HTTP/1.1, every read under a timeout and each request under a deadline (http_guard)."""

    receiver: Any  # the ReceiverServer (server.py imports this module), set on the bound subclass
    server_version = "p2pweights-receiver"

    def setup(self) -> None:
        super().setup()
        with self.receiver._state_lock:
            self.receiver._connections.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with self.receiver._state_lock:
                self.receiver._connections.discard(self.connection)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - BaseHTTPRequestHandler's name
        logger.debug("%s %s", self.address_string(), format % args)

    def _dispatch(self, method: str) -> None:
        parts = urlsplit(self.path)
        route, body = routes.BY_PATH.get(parts.path), {}
        try:  # before any route runs: the key, then a whole, well-formed body (http_guard)
            if parts.path not in routes.HEALTH_PATHS:
                http_guard.check_key(self, self.receiver.api_key)
            if route is not None and route.body is not None:  # a verb's few arguments, or a large body (bodies.Body.LARGE)
                limit = self.receiver.max_body if route.body.LARGE else min(self.receiver.max_body, bodies.SMALL_BODY_BYTES)
                body = http_guard.read_json_object(self, limit)
            else:  # a route that takes no body (health among them) never reads, let alone parses, one
                http_guard.skip_body(self)
        except http_guard.RequestRefused as e:
            return self._send(e.status, e.payload())
        if route is None:
            return self._send(p.NOT_FOUND, error_answers.error_payload(f"Not Found: {parts.path}"))
        if method not in route.methods:
            return self._send(p.METHOD_NOT_ALLOWED, error_answers.error_payload(
                f"Method Not Allowed: {parts.path} takes {' or '.join(route.methods)}"))
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        t0, times = time.perf_counter(), {}
        token = phases.collect(times)
        try:
            req = bodies.decode(route.body, body) if route.body is not None else None
            status, payload = sessions.gated(self.receiver, route.verb, self.headers,
                                             lambda: getattr(self, "_do_" + route.verb)(req, query))
            if route.verb in sessions.GATED and isinstance(payload, dict) and p.ok(status):
                payload = {**payload, p.TIMINGS_KEY: {"server_s": time.perf_counter() - t0, **times}}
        except (SessionConflict, TornWeights) as e:
            status, payload = p.CONFLICT, error_answers.error_payload(e)
        except (InvalidRequest, UnknownParameter) as e:  # the caller's input (a digest of a name it does not hold)
            status, payload = p.BAD_REQUEST, error_answers.error_payload(e)
        except OutOfOrder as e:
            status, payload = p.BAD_REQUEST, error_answers.error_payload(str(e))
        except Refused as e:
            status, payload = e.status, error_answers.error_payload(str(e), **e.fields)
        except Exception as e:  # noqa: BLE001 - a hook failed: report it, keep serving
            logger.error("receiver hook for %s failed:\n%s", parts.path, traceback.format_exc())
            what = e.message if isinstance(e, P2PWeightsError) else str(e)
            status, payload = p.ENGINE_FAILED, error_answer(e, f"{parts.path} failed in the engine: "
                                                        f"{type(e).__name__}: {what}")
        finally:
            phases.stop(token)
        self._send(status, payload)

    def _send(self, status: int, payload: Any) -> None:
        send_json(self, status, payload)

    # ---- one method per verb: (request body, query) -> (status, answer) ---------------------

    def _do_health(self, req: None, query: dict) -> tuple[int, Any]:
        return p.OK, self.receiver.session.health()  # None (sglang's empty body) unless updating or torn

    def _do_server_info(self, req: None, query: dict) -> tuple[int, Any]:
        # the engine's build first (sglang version, each rank's GPU architecture): the hook may say otherwise
        return p.OK, {**build_report.server_identity(self.receiver.registered_extras()), **self.receiver.hooks.server_info(),
                      "p2pw_weight_update": self.receiver.session.state()}

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
        extra["registered_from"] = self.client_address[0]  # the server's word, not the registrant's: senders check it
        self.receiver.register_transfer_engine_info(req.tp_rank, info["session_id"], info["weights_info_dict"], extra)
        return p.OK, "OK"

    def _do_pause_generation(self, req: bodies.PauseGenerationReq, query: dict) -> tuple[int, Any]:
        return p.OK, self.receiver._pause(req)

    def _do_continue_generation(self, req: bodies.ContinueGenerationReq, query: dict) -> tuple[int, Any]:
        return p.OK, self.receiver._continue(req)

    def _do_begin_weight_update(self, req: bodies.BeginWeightUpdateReq, query: dict) -> tuple[int, Any]:
        return p.OK, self.receiver._begin(req)

    def _do_end_weight_update(self, req: bodies.EndWeightUpdateReq, query: dict) -> tuple[int, Any]:
        return p.OK, self.receiver._end(req)

    def _do_update_weight_version(self, req: bodies.UpdateWeightVersionReq, query: dict) -> tuple[int, Any]:
        return p.OK, self.receiver._update_weight_version(req)

    def _do_weights_checker(self, req: bodies.CheckWeightsReq, query: dict) -> tuple[int, Any]:
        return self.receiver._weights_checker(req)

    def _do_get_weights_by_name(self, req: bodies.GetWeightsByNameReq, query: dict) -> tuple[int, Any]:
        return self.receiver._get_weights_by_name(req)

    def _do_p2pw_weights_digest(self, req: bodies.WeightsDigestReq, query: dict) -> tuple[int, Any]:
        return self.receiver._weights_digest(req)

    def _do_p2pw_apply_deltas(self, req: bodies.ApplyDeltasReq, query: dict) -> tuple[int, Any]:
        return p.OK, self.receiver._apply_now(req)

    def _do_init_weights_update_group(self, req: bodies.InitWeightsUpdateGroupReq, query: dict) -> tuple[int, Any]:
        return self.receiver._init_weights_update_group(req)

    def _do_update_weights_from_distributed(self, req: bodies.UpdateWeightsFromDistributedReq,
                                            query: dict) -> tuple[int, Any]:
        return self.receiver._update_weights_from_distributed(req)

    def _do_destroy_weights_update_group(self, req: bodies.DestroyWeightsUpdateGroupReq, query: dict) -> tuple[int, Any]:
        return self.receiver._destroy_weights_update_group(req)

    def _do_renew_weight_update(self, req: bodies.RenewWeightUpdateReq, query: dict) -> tuple[int, Any]:
        return p.OK, sessions.renew(self.receiver, req.release, self.headers)


def _rank(query: dict) -> int:
    try:
        rank = int(query["rank"])
    except (KeyError, ValueError):
        raise InvalidRequest("query parameter 'rank' must be an integer >= 0") from None
    if rank < 0:
        raise InvalidRequest(f"query parameter 'rank' must be an integer >= 0, got {rank}")
    return rank
