"""The HTTP control server a receiver engine runs: sglang 0.5.23's control routes, same bodies.

Any PyTorch engine becomes a p2pweights receiver by running one ``ReceiverServer`` and giving it
hooks. p2pweights' engine client (``p2pweights.control.SglangEngine``) cannot tell it from an
sglang server for the routes below; docs/protocol.md has the whole table.

An engine with T ranks (T processes): one ``ReceiverServer`` per engine, in whichever process
drives the engine (rank 0, or a frontend). Its control hooks (pause, begin, end, ...) fan out to
the ranks by the engine's own means, as sglang's tokenizer manager fans out to its schedulers.
Each rank publishes its weight regions the way sglang ranks do: ``register_transfer_engine_info``
(an HTTP PUT of sglang's own bootstrap body) to the server, from any process; the server answers
``GET /remote_instance_transfer_engine_info?rank=N`` and the bootstrap route
``GET /get_transfer_engine_info?rank=N`` from what was registered (or from the
``transfer_engine_info`` hook, which wins when it returns something). One port serves both the
HTTP-server and the bootstrap-server roles. ``/server_info`` also says the engine's build, from what
the ranks registered: ``version`` (as sglang's does) and ``p2pw_device_archs`` (:mod:`.identity`).

State: ``generating`` -> ``pause_generation`` -> ``paused`` -> ``begin_weight_update`` ->
``updating`` -> ``end_weight_update`` -> ``paused`` -> ``update_weight_version`` ->
``continue_generation`` -> ``generating``. Out-of-order calls answer 400 with sglang's body
``{"success": false, "message": ...}`` (plus p2pweights' ``error`` object: every error answer is
``control.protocol.error_payload``). Stricter than sglang, because one-sided writes land in live
parameter memory: ``begin_weight_update`` needs the engine paused, and ``update_weight_version``
is refused while an update session is open (the version is bumped only after the update ended).

Also served, for the broadcast baseline (``p2pweights.baseline.broadcast``): sglang's
``/init_weights_update_group``, ``/update_weights_from_distributed`` (only inside an update session,
as in sglang 0.5.23) and ``/destroy_weights_update_group``, through the hooks of the same names.
A registration may carry extra publication keys (NIXL's ``transport``, ``agent_metadata``,
``location``), served next to ``remote_instance_transfer_engine_info``; keys starting with ``p2pw_``
only reach the ``on_register_transfer_engine_info`` hook. docs/receiver.md has the details.

Routes, bodies, status codes and the error payload are :mod:`p2pweights.control.protocol`'s.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import socket
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..control import protocol as p
from ..errors import InvalidRequest, P2PWeightsError, SessionConflict, TornWeights
from ..settings import value as setting
from . import http_guard, identity, phases
from . import session as sessions
from .registration import register_transfer_engine_info  # noqa: F401 - re-exported: it used to live here

logger = logging.getLogger(__name__)

class ReceiverHooks:
    """What the engine does for each control call. Subclass and override what your engine needs;
    the defaults are no-ops. A hook that raises makes the call answer 500 with the error's text,
    and leaves the state unchanged (so ``end_weight_update`` can be retried). A hook that raises a
    ``p2pweights.errors`` class (``LayoutMismatch(..., rank=1, parameter=..., hint=...)``) reaches
    the client as that class with those fields.

    Hooks run on the server's request threads; control hooks (pause, continue, begin, end,
    weight version) run one at a time, never concurrently with each other.
    """

    def server_info(self) -> dict:
        """``GET /server_info``: the engine's resolved server args (sglang's field names: tp_size,
        dtype, quantization, ...), as the sender builds its replica from them."""
        return {}

    def model_info(self) -> dict:
        """``GET /model_info``: model_path, architectures, ...; the server adds ``weight_version``."""
        return {}

    def transfer_engine_info(self, rank: int) -> Any:
        """Rank ``rank``'s published regions: the value served as
        ``remote_instance_transfer_engine_info`` (sglang's ``[session_id, {name: [ptr, numel, elem_size]}]``,
        or the NIXL form of p2pweights.transport.publication). None: use what the rank registered."""
        return None

    def on_pause(self, mode: str) -> None:
        """Stop generating (mode: abort | retract | in_place, as sglang's PauseGenerationReqInput)."""

    def on_continue(self, torch_empty_cache: bool) -> None:
        """Generate again."""

    def on_begin_update(self, selector: str) -> None:
        """A weight update starts: make the parameters writable (e.g. undo in-place packing)."""

    def on_end_update(self) -> None:
        """Every write landed: run the engine's post-processing (post_load_weights,
        process_weights_after_loading, derived buffers)."""

    def on_weight_version(self, new_version: str, abort_all_requests: bool) -> None:
        """The version was bumped (the server tracks it; this is for the engine's own use)."""

    def weights_checker(self, request: dict) -> dict:
        """``/weights_checker`` with sglang's CheckWeightsReqInput fields (defaults filled).
        Return sglang's answer: ``{"success": bool, "message": str, ["ranks"], ["per_engine_checksum"]}``."""
        return {"success": False, "message": "this engine does not implement weights_checker"}

    def get_weights_by_name(self, name: str, truncate_size: int) -> Any:
        """The parameter's first ``truncate_size`` rows (a tensor or nested lists); None if unknown."""
        return None

    def weights_digest(self, names: dict[int, list[str]]) -> dict[int, dict[str, str]]:
        """``POST /p2pw_weights_digest`` (``update(verify=True)``): for each engine rank, the digest
        (``p2pweights.receiver.digest``) of the bytes it holds for each named parameter. Raise
        NotImplementedError (the default) to answer 501 (an sglang server answers 404: no route)."""
        raise NotImplementedError("this engine does not digest its weights (/p2pw_weights_digest)")

    def on_renew_lease(self) -> None:
        """The session's owner renewed its lease: check, cheaply, that every rank of the engine still
        answers; raise (naming the rank) when one does not, so a stalled rank is found while the
        owner still holds the engine."""

    def on_register_transfer_engine_info(self, rank: int, info: dict) -> None:
        """A rank registered its regions (``PUT /register_transfer_engine_info``); ``info`` is the whole
        ``transfer_engine_info`` object, extra keys included (keys starting with ``p2pw_`` are for the
        engine only and are not published)."""

    # the broadcast path (sglang's update_weights_from_distributed), for the baseline -------------
    def init_weights_update_group(self, request: dict) -> None:
        """``POST /init_weights_update_group`` (InitWeightsUpdateGroupReqInput: master_address,
        master_port, rank_offset, world_size, group_name, backend): every rank joins the group.
        Raise to answer 400 with the error's text."""
        raise NotImplementedError("this engine does not implement init_weights_update_group")

    def update_weights_from_distributed(self, request: dict) -> None:
        """``POST /update_weights_from_distributed`` (UpdateWeightsFromDistributedReqInput: names, dtypes,
        shapes, group_name, ...): receive each tensor by broadcast from group rank 0 and load it."""
        raise NotImplementedError("this engine does not implement update_weights_from_distributed")

    def destroy_weights_update_group(self, group_name: str) -> None:
        """``POST /destroy_weights_update_group``: leave the group."""
        raise NotImplementedError("this engine does not implement destroy_weights_update_group")


class _Conflict(Exception):
    """An out-of-order control call (answered 400 like sglang, with its success/message body)."""


class _Refused(Exception):
    """A call the engine refuses with sglang's status and message (400 unless said otherwise)."""

    def __init__(self, message: str, status: int = p.BAD_REQUEST, **fields: Any):
        super().__init__(message)
        self.status, self.fields = status, fields


class ReceiverServer:
    """``ReceiverServer(hooks, host="127.0.0.1", port=0)``; ``.start()``, ``.url``, ``.close()``.

    ``port=0`` picks a free port (read it from ``.url`` / ``.port`` after ``start``).
    ``weight_version`` is the version reported before the first update (sglang's default: "default").
    ``api_key`` (default ``P2PW_API_KEY``): every route but the health routes answers 401 without
    ``Authorization: Bearer KEY`` (sglang's ``--api-key``). ``max_body``: bytes a request body may
    have (413 above it); ``read_timeout``: seconds a client may stall while sending a request
    (408, connection closed); see :mod:`.http_guard`.
    """

    def __init__(self, hooks: ReceiverHooks | None = None, host: str = "127.0.0.1", port: int = 0, *,
                 weight_version: str = "default", api_key: str | None = None,
                 max_body: int = http_guard.MAX_BODY_BYTES, read_timeout: float = http_guard.READ_TIMEOUT):
        self.hooks = hooks if hooks is not None else ReceiverHooks()
        self.api_key: str | None = setting("P2PW_API_KEY", api_key)
        self.max_body = int(max_body)
        self.read_timeout = float(read_timeout)
        self.host = host
        self._requested_port = int(port)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._state_lock = threading.Lock()      # guards the fields below; held only briefly
        self._control_lock = threading.RLock()   # one control hook at a time (re-taken inside sessions.gated)
        self.session = sessions.SessionKeeper()  # the session's owner, lease and torn mark (receiver.session)
        self.weight_version = str(weight_version)
        self.paused = False
        self.updating = False
        self.update_selector: str | None = None
        self._registered: dict[int, list] = {}   # tp rank -> [session_id, weights_info_dict]
        self._registered_extra: dict[int, dict] = {}  # tp rank -> extra published keys (NIXL: transport, ...)
        self._closed = False
        self._connections: set = set()  # open client connections (kept alive between calls)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "ReceiverServer":
        if self._closed:
            raise RuntimeError("ReceiverServer was closed; create a new one")
        if self._httpd is not None:
            return self
        handler = type("_BoundHandler", (_Handler,), {"receiver": self, "timeout": self.read_timeout})
        self._httpd = ThreadingHTTPServer((self.host, self._requested_port), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"p2pw-receiver-{self.port}", daemon=True)
        self._thread.start()
        self.session.engine = self.url
        logger.info("p2pweights receiver control server on %s", self.url)
        return self

    @property
    def port(self) -> int:
        if self._httpd is None:
            raise RuntimeError("ReceiverServer is not started; call start()")
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = self.host if self.host not in ("0.0.0.0", "") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        """Stop serving and free the port. Idempotent."""
        self._closed = True
        httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()
        with self._state_lock:  # a kept-alive connection must not reach this closed server's state
            connections, self._connections = set(self._connections), set()
        for conn in connections:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> "ReceiverServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_httpd", None) is not None:
            import warnings
            warnings.warn("ReceiverServer was not closed; call close()", ResourceWarning, stacklevel=2)

    # ---- transfer-engine info registry (sglang's bootstrap-server role) ------------------------

    def register_transfer_engine_info(self, rank: int, session_id: str, weights_info: dict,
                                      extra: dict | None = None) -> None:
        """In-process form of ``PUT /register_transfer_engine_info``. ``extra``: more keys of the
        rank's publication, served next to ``remote_instance_transfer_engine_info`` (NIXL's
        ``transport``, ``agent_metadata``, ``location``); keys starting with ``p2pw_`` go only to the
        ``on_register_transfer_engine_info`` hook."""
        if int(rank) < 0:
            raise ValueError(f"rank must be >= 0, got {rank}")
        extra = dict(extra or {})
        self.hooks.on_register_transfer_engine_info(
            int(rank), {"session_id": session_id, "weights_info_dict": weights_info, **extra})
        with self._state_lock:
            self._registered[int(rank)] = [session_id, weights_info]
            self._registered_extra[int(rank)] = {k: v for k, v in extra.items() if not k.startswith("p2pw_")}

    def registered_extras(self) -> dict[int, dict]:
        """Each registered rank's extra publication keys (``device_arch``, ``sglang_version``, NIXL's ...)."""
        with self._state_lock:
            return {r: dict(extra) for r, extra in self._registered_extra.items()}

    def _transfer_engine_info(self, rank: int) -> tuple[Any, dict]:
        info = self.hooks.transfer_engine_info(rank)
        if info is not None:
            return info, {}
        with self._state_lock:
            return self._registered.get(rank), dict(self._registered_extra.get(rank, {}))

    # ---- control verbs (called by the handler) -------------------------------------------------

    def state(self) -> str:
        if self.updating:
            return "updating"
        return "paused" if self.paused else "generating"

    def _pause(self, req: p.PauseGenerationReq) -> dict:
        with self._control_lock:
            self.hooks.on_pause(req.mode)     # idempotent, like sglang: pausing a paused engine is fine
            self.paused = True
        return p.encode(p.GenerationAck("Generation paused successfully."))

    def _continue(self, req: p.ContinueGenerationReq) -> dict:
        with self._control_lock:
            if self.updating:
                logger.warning("continue_generation while a weight-update session is open: the engine "
                               "serves weights that are partly written")
            self.hooks.on_continue(req.torch_empty_cache)
            self.paused = False
        return p.encode(p.GenerationAck("Generation continued successfully."))

    def _begin(self, req: p.BeginWeightUpdateReq) -> dict:
        with self._control_lock:
            if not self.paused:
                raise _Conflict("generation is running; call pause_generation() before begin_weight_update() "
                                "(p2pweights writes land in live parameter memory)")
            if self.updating and self.session.owner is None:  # torn: taken over, not begun again
                return p.encode(p.Ack(message=f"took over a {p.TORN} weight-update session: a complete update heals it"))
            if self.updating:
                raise _Conflict(f"a weight-update session is {p.SESSION_ALREADY_OPEN}; call end_weight_update() first")
            self.hooks.on_begin_update(req.selector)
            self.updating, self.update_selector = True, req.selector
        return {**p.encode(p.Ack()), p.END_FOLDS: True}  # this end may bump the version and continue too

    def _end(self, req: p.EndWeightUpdateReq) -> dict:
        then = p.end_then(req)  # checked before anything runs
        with self._control_lock:
            if not self.updating:
                raise _Conflict(f"{p.NO_SESSION} is open; call begin_weight_update() first")
            self.hooks.on_end_update()
            self.updating, self.update_selector = False, None
            if then is None:
                return p.encode(p.Ack())
            self.session.end()  # over before what follows it (sessions.gated records it again: no-op)
            done: dict[str, dict] = {}
            # then, as the owner's own next calls would: the version, then (only once it is bumped) continue
            steps = [("update_weight_version", lambda: self._update_weight_version(
                p.UpdateWeightVersionReq(new_version=then["new_version"], abort_all_requests=False)))]
            if then["continue"]:
                steps.append(("continue_generation", lambda: self._continue(
                    p.ContinueGenerationReq(torch_empty_cache=then["torch_empty_cache"]))))
            for verb, step in steps:
                t0 = time.perf_counter()
                try:
                    done[verb] = step()
                    phases.record_phase(f"{verb}_s", time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001 - ended already: the answer says what failed after it
                    logger.error("%s after end_weight_update failed:\n%s", verb, traceback.format_exc())
                    what = e.message if isinstance(e, P2PWeightsError) else str(e)
                    done[verb] = _error(e, f"{verb} failed in the engine after end_weight_update: "
                                           f"{type(e).__name__}: {what}")
                    break
        return {**p.encode(p.Ack()), p.END_THEN: done}

    def _update_weight_version(self, req: p.UpdateWeightVersionReq) -> dict:
        with self._control_lock:
            if self.updating:
                raise _Conflict("a weight-update session is open; call end_weight_update() before "
                                "update_weight_version() (the version is bumped only after the update ended)")
            self.hooks.on_weight_version(req.new_version, req.abort_all_requests)
            self.weight_version = req.new_version
        return p.encode(p.WeightVersionAck(f"Weight version updated to {req.new_version}", req.new_version))

    def _weights_checker(self, req: p.CheckWeightsReq) -> tuple[int, dict]:
        # sglang's fields, then those it does not define (e.g. p2pweights' hf_seed) as they came
        request = {"action": req.action, "allow_quant_error": req.allow_quant_error,
                   "skip_tensor_list": req.skip_tensor_list, "selector": req.selector}
        request.update({k: v for k, v in req.extra.items() if k not in request})
        answer = dict(self.hooks.weights_checker(request))
        answer.setdefault("success", False)
        answer.setdefault("message", "")
        # sglang's answer either way (an unequal check is a result, not an error)
        return (p.OK if answer["success"] else p.BAD_REQUEST), answer

    def _weights_digest(self, req: p.WeightsDigestReq) -> tuple[int, dict]:
        from .digest import ALGORITHM

        try:
            names = {int(r): [str(n) for n in ns] for r, ns in req.names.items()}
        except (TypeError, ValueError):
            raise InvalidRequest("field 'names' must map an engine rank to a list of parameter names") from None
        try:  # not under the control lock: it only reads, and the caller wrote before asking
            digests = self.hooks.weights_digest(names)
        except NotImplementedError as e:
            raise _Refused(str(e), p.NOT_IMPLEMENTED) from None
        return p.OK, {"success": True, "algorithm": ALGORITHM,
                      "ranks": {str(r): dict(d) for r, d in digests.items()}}

    def _get_weights_by_name(self, req: p.GetWeightsByNameReq) -> tuple[int, Any]:
        value = self.hooks.get_weights_by_name(req.name, req.truncate_size)
        if value is None:
            raise _Refused("Get parameter by name failed", parameter=req.name)  # sglang's message
        if hasattr(value, "tolist"):
            value = value.tolist()
        return p.OK, value

    def _init_weights_update_group(self, req: p.InitWeightsUpdateGroupReq) -> tuple[int, dict]:
        try:  # not under the control lock: joining waits for every member, the sender included
            self.hooks.init_weights_update_group(dataclasses.asdict(req))
        except Exception as e:  # noqa: BLE001 - sglang answers 400 with the reason
            logger.error("init_weights_update_group failed: %s", e)
            return p.BAD_REQUEST, _error(e, f"Failed to initialize custom process group: {e}.")
        return p.OK, p.encode(p.Ack(message="Succeeded to initialize custom process group."))

    def _destroy_weights_update_group(self, req: p.DestroyWeightsUpdateGroupReq) -> tuple[int, dict]:
        try:
            self.hooks.destroy_weights_update_group(req.group_name)
        except Exception as e:  # noqa: BLE001
            return p.BAD_REQUEST, _error(e, f"Failed to destroy custom process group: {e}.")
        return p.OK, p.encode(p.Ack(message="Succeeded to destroy custom process group."))

    def _update_weights_from_distributed(self, req: p.UpdateWeightsFromDistributedReq) -> tuple[int, dict]:
        with self._control_lock:
            if not self.updating:  # sglang 0.5.23's rule and message
                raise _Refused("update_weights_from_distributed must run between begin_weight_update() and "
                               "end_weight_update()")
            try:
                self.hooks.update_weights_from_distributed(dataclasses.asdict(req))
            except Exception as e:  # noqa: BLE001 - sglang answers 400 with the reason
                logger.error("update_weights_from_distributed failed:\n%s", traceback.format_exc())
                return p.BAD_REQUEST, _error(e, f"Failed to update parameter online: {e}")
            if req.weight_version is not None:
                self.weight_version = req.weight_version
        return p.OK, p.encode(p.Ack(message="Succeeded to update parameter online."))

    def _model_info(self) -> dict:
        info = dict(self.hooks.model_info())
        info["weight_version"] = self.weight_version
        return info


def _error(e: BaseException, message: str) -> dict:
    """The error payload of a hook's exception, with sglang's message for the route."""
    fields = e.fields() if isinstance(e, P2PWeightsError) else {}
    return p.error_payload(message, type_name=type(e).__name__ if isinstance(e, P2PWeightsError) else None,
                           **fields)


def send_json(handler: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
    """Answer an HTTP request with a JSON body (none for ``payload=None``); a client that already
    gave up (its timeout) is not our error."""
    data = b"" if payload is None else json.dumps(payload).encode()
    try:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        if handler.close_connection:  # a refused request's connection is closed: the client must not keep it
            handler.send_header("Connection", "close")
        handler.end_headers()
        handler.wfile.write(data)
    except OSError:  # broken pipe, reset, or a write past the socket's timeout
        logger.debug("client left before the answer to %s", handler.path)
        handler.close_connection = True


class _Handler(BaseHTTPRequestHandler):
    receiver: ReceiverServer  # set on the bound subclass
    server_version = "p2pweights-receiver"
    protocol_version = "HTTP/1.1"  # keep-alive: a client's next verb reuses the connection (control.http)
    disable_nagle_algorithm = True  # an answer's headers and body are two writes: no 40 ms delayed-ACK stall
    timeout = http_guard.READ_TIMEOUT  # every read of a request: a stalled client cannot hold a thread

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
        try:  # before any route is looked at: the key, then a whole, well-formed body (http_guard)
            if parts.path not in p.HEALTH_PATHS:
                http_guard.check_key(self, self.receiver.api_key, limit=self.receiver.max_body)
            body = http_guard.read_json_object(self, self.receiver.max_body)
        except http_guard.RequestRefused as e:
            return self._send(e.status, e.payload())
        route = p.BY_PATH.get(parts.path)
        if route is None:
            return self._send(p.NOT_FOUND, p.error_payload(f"Not Found: {parts.path}"))
        if method not in route.methods:
            return self._send(p.METHOD_NOT_ALLOWED, p.error_payload(
                f"Method Not Allowed: {parts.path} takes {' or '.join(route.methods)}"))
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        t0, times = time.perf_counter(), {}
        token = phases.collect(times)
        try:
            req = p.decode(route.body, body) if route.body is not None else None
            status, payload = sessions.gated(self.receiver, route.verb, self.headers,
                                             lambda: getattr(self, "_do_" + route.verb)(req, query))
            if route.verb in sessions.GATED and isinstance(payload, dict) and p.ok(status):
                payload = {**payload, phases.TIMINGS_KEY: {"server_s": time.perf_counter() - t0, **times}}
        except (SessionConflict, TornWeights) as e:
            status, payload = p.CONFLICT, p.error_payload(e)
        except InvalidRequest as e:
            status, payload = p.BAD_REQUEST, p.error_payload(e)
        except _Conflict as e:
            status, payload = p.BAD_REQUEST, p.error_payload(str(e))
        except _Refused as e:
            status, payload = e.status, p.error_payload(str(e), **e.fields)
        except Exception as e:  # noqa: BLE001 - a hook failed: report it, keep serving
            logger.error("receiver hook for %s failed:\n%s", parts.path, traceback.format_exc())
            what = e.message if isinstance(e, P2PWeightsError) else str(e)
            status, payload = p.ENGINE_FAILED, _error(e, f"{parts.path} failed in the engine: "
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
        return p.OK, {**identity.server_identity(self.receiver.registered_extras()), **self.receiver.hooks.server_info(),
                      "p2pw_weight_update": self.receiver.session.state()}

    def _do_model_info(self, req: None, query: dict) -> tuple[int, Any]:
        return p.OK, self.receiver._model_info()

    def _do_remote_instance_transfer_engine_info(self, req: None, query: dict) -> tuple[int, Any]:
        rank = _rank(query)  # sglang answers 400 for both a bad rank and a rank with nothing published
        info, extra = self.receiver._transfer_engine_info(rank)
        if info is None:
            raise _Refused(f"Failed to get transfer engine info for rank {rank}", rank=rank)
        return p.OK, p.encode(p.TransferEngineInfo(rank, info, extra))

    def _do_get_transfer_engine_info(self, req: None, query: dict) -> tuple[int, Any]:
        rank = _rank(query)
        info, extra = self.receiver._transfer_engine_info(rank)
        if info is None:  # the bootstrap server's answer
            raise _Refused(f"No transfer engine info for rank {rank}", p.NOT_FOUND, rank=rank)
        return p.OK, p.encode(p.TransferEngineInfo(rank, info, extra))

    def _do_register_transfer_engine_info(self, req: p.RegisterTransferEngineInfoReq, query: dict) -> tuple[int, Any]:
        info = req.transfer_engine_info
        extra = {k: v for k, v in info.items() if k not in ("session_id", "weights_info_dict")}
        extra["registered_from"] = self.client_address[0]  # the server's word, not the registrant's: senders check it
        self.receiver.register_transfer_engine_info(req.tp_rank, info["session_id"], info["weights_info_dict"], extra)
        return p.OK, "OK"

    def _do_pause_generation(self, req: p.PauseGenerationReq, query: dict) -> tuple[int, Any]:
        return p.OK, self.receiver._pause(req)

    def _do_continue_generation(self, req: p.ContinueGenerationReq, query: dict) -> tuple[int, Any]:
        return p.OK, self.receiver._continue(req)

    def _do_begin_weight_update(self, req: p.BeginWeightUpdateReq, query: dict) -> tuple[int, Any]:
        return p.OK, self.receiver._begin(req)

    def _do_end_weight_update(self, req: p.EndWeightUpdateReq, query: dict) -> tuple[int, Any]:
        return p.OK, self.receiver._end(req)

    def _do_update_weight_version(self, req: p.UpdateWeightVersionReq, query: dict) -> tuple[int, Any]:
        return p.OK, self.receiver._update_weight_version(req)

    def _do_weights_checker(self, req: p.CheckWeightsReq, query: dict) -> tuple[int, Any]:
        return self.receiver._weights_checker(req)

    def _do_get_weights_by_name(self, req: p.GetWeightsByNameReq, query: dict) -> tuple[int, Any]:
        return self.receiver._get_weights_by_name(req)

    def _do_p2pw_weights_digest(self, req: p.WeightsDigestReq, query: dict) -> tuple[int, Any]:
        return self.receiver._weights_digest(req)

    def _do_init_weights_update_group(self, req: p.InitWeightsUpdateGroupReq, query: dict) -> tuple[int, Any]:
        return self.receiver._init_weights_update_group(req)

    def _do_update_weights_from_distributed(self, req: p.UpdateWeightsFromDistributedReq,
                                            query: dict) -> tuple[int, Any]:
        return self.receiver._update_weights_from_distributed(req)

    def _do_destroy_weights_update_group(self, req: p.DestroyWeightsUpdateGroupReq, query: dict) -> tuple[int, Any]:
        return self.receiver._destroy_weights_update_group(req)

    def _do_renew_weight_update(self, req: p.RenewWeightUpdateReq, query: dict) -> tuple[int, Any]:
        return p.OK, sessions.renew(self.receiver, req.release, self.headers)


def _rank(query: dict) -> int:
    try:
        rank = int(query["rank"])
    except (KeyError, ValueError):
        raise InvalidRequest("query parameter 'rank' must be an integer >= 0") from None
    if rank < 0:
        raise InvalidRequest(f"query parameter 'rank' must be an integer >= 0, got {rank}")
    return rank
