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
HTTP-server and the bootstrap-server roles.

State: ``generating`` -> ``pause_generation`` -> ``paused`` -> ``begin_weight_update`` ->
``updating`` -> ``end_weight_update`` -> ``paused`` -> ``update_weight_version`` ->
``continue_generation`` -> ``generating``. Out-of-order calls answer 400 with sglang's body
``{"success": false, "message": ...}``. Stricter than sglang, because one-sided writes land in live
parameter memory: ``begin_weight_update`` needs the engine paused, and ``update_weight_version``
is refused while an update session is open (the version is bumped only after the update ended).

Also served, for the broadcast baseline (``p2pweights.baseline.broadcast``): sglang's
``/init_weights_update_group``, ``/update_weights_from_distributed`` (only inside an update session,
as in sglang 0.5.23) and ``/destroy_weights_update_group``, through the hooks of the same names.
A registration may carry extra publication keys (NIXL's ``transport``, ``agent_metadata``,
``location``), served next to ``remote_instance_transfer_engine_info``; keys starting with ``p2pw_``
only reach the ``on_register_transfer_engine_info`` hook. docs/receiver.md has the details.
"""
from __future__ import annotations

import json
import logging
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..errors import EngineError

logger = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
SELECTORS = ("target", "draft", "all")


class ReceiverHooks:
    """What the engine does for each control call. Subclass and override what your engine needs;
    the defaults are no-ops. A hook that raises makes the call answer 500 with the error's text,
    and leaves the state unchanged (so ``end_weight_update`` can be retried).

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


class _BadRequest(Exception):
    pass


class _Conflict(Exception):
    """An out-of-order control call (answered 400 like sglang, with its success/message body)."""


class ReceiverServer:
    """``ReceiverServer(hooks, host="127.0.0.1", port=0)``; ``.start()``, ``.url``, ``.close()``.

    ``port=0`` picks a free port (read it from ``.url`` / ``.port`` after ``start``).
    ``weight_version`` is the version reported before the first update (sglang's default: "default").
    """

    def __init__(self, hooks: ReceiverHooks | None = None, host: str = "127.0.0.1", port: int = 0, *,
                 weight_version: str = "default"):
        self.hooks = hooks if hooks is not None else ReceiverHooks()
        self.host = host
        self._requested_port = int(port)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._state_lock = threading.Lock()      # guards the fields below; held only briefly
        self._control_lock = threading.Lock()    # one control hook at a time
        self.weight_version = str(weight_version)
        self.paused = False
        self.updating = False
        self.update_selector: str | None = None
        self._registered: dict[int, list] = {}   # tp rank -> [session_id, weights_info_dict]
        self._registered_extra: dict[int, dict] = {}  # tp rank -> extra published keys (NIXL: transport, ...)
        self._closed = False

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "ReceiverServer":
        if self._closed:
            raise RuntimeError("ReceiverServer was closed; create a new one")
        if self._httpd is not None:
            return self
        handler = type("_BoundHandler", (_Handler,), {"receiver": self})
        self._httpd = ThreadingHTTPServer((self.host, self._requested_port), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name=f"p2pw-receiver-{self.port}", daemon=True)
        self._thread.start()
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

    def _pause(self, body: dict) -> dict:
        mode = _field(body, "mode", str, "abort", choices=PAUSE_MODES)
        with self._control_lock:
            self.hooks.on_pause(mode)     # idempotent, like sglang: pausing a paused engine is fine
            self.paused = True
        return {"message": "Generation paused successfully.", "status": "ok"}

    def _continue(self, body: dict) -> dict:
        empty_cache = _field(body, "torch_empty_cache", bool, True)
        with self._control_lock:
            if self.updating:
                logger.warning("continue_generation while a weight-update session is open: the engine "
                               "serves weights that are partly written")
            self.hooks.on_continue(empty_cache)
            self.paused = False
        return {"message": "Generation continued successfully.", "status": "ok"}

    def _begin(self, body: dict) -> dict:
        selector = _field(body, "selector", str, "all", choices=SELECTORS)
        with self._control_lock:
            if self.updating:
                raise _Conflict("a weight-update session is already open; call end_weight_update() first")
            if not self.paused:
                raise _Conflict("generation is running; call pause_generation() before begin_weight_update() "
                                "(p2pweights writes land in live parameter memory)")
            self.hooks.on_begin_update(selector)
            self.updating, self.update_selector = True, selector
        return {"success": True, "message": "Success"}

    def _end(self, body: dict) -> dict:
        with self._control_lock:
            if not self.updating:
                raise _Conflict("no weight-update session is open; call begin_weight_update() first")
            self.hooks.on_end_update()
            self.updating, self.update_selector = False, None
        return {"success": True, "message": "Success"}

    def _update_weight_version(self, body: dict) -> dict:
        new_version = _field(body, "new_version", str, required=True)
        abort_all = _field(body, "abort_all_requests", bool, True)
        with self._control_lock:
            if self.updating:
                raise _Conflict("a weight-update session is open; call end_weight_update() before "
                                "update_weight_version() (the version is bumped only after the update ended)")
            self.hooks.on_weight_version(new_version, abort_all)
            self.weight_version = new_version
        return {"success": True, "message": f"Weight version updated to {new_version}", "new_version": new_version}

    def _weights_checker(self, body: dict) -> tuple[int, dict]:
        request = {
            "action": _field(body, "action", str, "checksum"),
            "allow_quant_error": _field(body, "allow_quant_error", bool, False),
            "skip_tensor_list": _field(body, "skip_tensor_list", list, None),
            "selector": _field(body, "selector", str, "all", choices=SELECTORS),
        }
        # fields sglang does not define (e.g. p2pweights' hf_seed) go to the hook as they are
        request.update({k: v for k, v in body.items() if k not in request})
        answer = dict(self.hooks.weights_checker(request))
        answer.setdefault("success", False)
        answer.setdefault("message", "")
        return (200 if answer["success"] else 400), answer

    def _get_weights_by_name(self, body: dict) -> tuple[int, Any]:
        name = _field(body, "name", str, required=True)
        truncate_size = _field(body, "truncate_size", int, 100)
        value = self.hooks.get_weights_by_name(name, truncate_size)
        if value is None:
            return 400, {"error": {"message": "Get parameter by name failed"}}
        if hasattr(value, "tolist"):
            value = value.tolist()
        return 200, value

    def _init_weights_update_group(self, body: dict) -> tuple[int, dict]:
        request = {
            "master_address": _field(body, "master_address", str, required=True),
            "master_port": _field(body, "master_port", int, required=True),
            "rank_offset": _field(body, "rank_offset", int, required=True),
            "world_size": _field(body, "world_size", int, required=True),
            "group_name": _field(body, "group_name", str, "weight_update_group"),
            "backend": _field(body, "backend", str, "nccl"),
        }
        try:  # not under the control lock: joining waits for every member, the sender included
            self.hooks.init_weights_update_group(request)
        except Exception as e:  # noqa: BLE001 - sglang answers 400 with the reason
            logger.error("init_weights_update_group failed: %s", e)
            return 400, {"success": False, "message": f"Failed to initialize custom process group: {e}."}
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def _destroy_weights_update_group(self, body: dict) -> tuple[int, dict]:
        group_name = _field(body, "group_name", str, "weight_update_group")
        try:
            self.hooks.destroy_weights_update_group(group_name)
        except Exception as e:  # noqa: BLE001
            return 400, {"success": False, "message": f"Failed to destroy custom process group: {e}."}
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    def _update_weights_from_distributed(self, body: dict) -> tuple[int, dict]:
        names = _field(body, "names", list, required=True)
        request = {
            "names": names,
            "dtypes": _field(body, "dtypes", list, required=True),
            "shapes": _field(body, "shapes", list, required=True),
            "group_name": _field(body, "group_name", str, "weight_update_group"),
            "flush_cache": _field(body, "flush_cache", bool, True),
            "abort_all_requests": _field(body, "abort_all_requests", bool, False),
            "weight_version": _field(body, "weight_version", str, None),
            "load_format": _field(body, "load_format", str, None),
            "selector": _field(body, "selector", str, "all", choices=SELECTORS),
            "torch_empty_cache": _field(body, "torch_empty_cache", bool, False),
        }
        if not len(names) == len(request["dtypes"]) == len(request["shapes"]):
            raise _BadRequest("names, dtypes and shapes must have the same length")
        with self._control_lock:
            if not self.updating:  # sglang 0.5.23's rule and message
                return 400, {"success": False, "message": "update_weights_from_distributed must run between "
                                                          "begin_weight_update() and end_weight_update()"}
            try:
                self.hooks.update_weights_from_distributed(request)
            except Exception as e:  # noqa: BLE001 - sglang answers 400 with the reason
                logger.error("update_weights_from_distributed failed:\n%s", traceback.format_exc())
                return 400, {"success": False, "message": f"Failed to update parameter online: {e}"}
            if request["weight_version"] is not None:
                self.weight_version = request["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    def _model_info(self) -> dict:
        info = dict(self.hooks.model_info())
        info["weight_version"] = self.weight_version
        return info


def _field(body: dict, name: str, kind: type, default: Any = None, *, required: bool = False,
           choices: tuple | None = None) -> Any:
    if name not in body or body[name] is None:
        if required:
            raise _BadRequest(f"field {name!r} is required")
        return default
    value = body[name]
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise _BadRequest(f"field {name!r} must be {kind.__name__}, got {type(value).__name__}")
    if choices is not None and value not in choices:
        raise _BadRequest(f"field {name!r} must be one of {', '.join(choices)}, got {value!r}")
    return value


# route table: path -> (allowed methods, handler name). The same paths and methods as sglang 0.5.23.
_GET, _POST, _GET_POST, _PUT = ("GET",), ("POST",), ("GET", "POST"), ("PUT",)
ROUTES: dict[str, tuple[tuple[str, ...], str]] = {
    "/health": (_GET, "health"),
    "/health_generate": (_GET, "health"),
    "/ready": (_GET, "health"),
    "/server_info": (_GET, "server_info"),
    "/get_server_info": (_GET, "server_info"),
    "/model_info": (_GET, "model_info"),
    "/get_model_info": (_GET, "model_info"),
    "/remote_instance_transfer_engine_info": (_GET, "remote_instance_transfer_engine_info"),
    "/get_remote_instance_transfer_engine_info": (_GET, "remote_instance_transfer_engine_info"),
    "/pause_generation": (_POST, "pause_generation"),
    "/continue_generation": (_POST, "continue_generation"),
    "/begin_weight_update": (_POST, "begin_weight_update"),
    "/end_weight_update": (_POST, "end_weight_update"),
    "/update_weight_version": (_POST, "update_weight_version"),
    "/weights_checker": (_GET_POST, "weights_checker"),
    "/get_weights_by_name": (_GET_POST, "get_weights_by_name"),
    # the broadcast path (sglang's update_weights_from_distributed), served for the baseline
    "/init_weights_update_group": (_POST, "init_weights_update_group"),
    "/update_weights_from_distributed": (_POST, "update_weights_from_distributed"),
    "/destroy_weights_update_group": (_POST, "destroy_weights_update_group"),
}
# sglang's engine-info bootstrap server routes (--engine-info-bootstrap-port), served on the same port
BOOTSTRAP_ROUTES: dict[str, tuple[tuple[str, ...], str]] = {
    "/get_transfer_engine_info": (_GET, "get_transfer_engine_info"),
    "/register_transfer_engine_info": (_PUT, "register_transfer_engine_info"),
}
_ALL_ROUTES = {**ROUTES, **BOOTSTRAP_ROUTES}


def send_json(handler: BaseHTTPRequestHandler, status: int, payload: Any) -> None:
    """Answer an HTTP request with a JSON body (none for ``payload=None``); a client that already
    gave up (its timeout) is not our error."""
    data = b"" if payload is None else json.dumps(payload).encode()
    try:
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):
        logger.debug("client left before the answer to %s", handler.path)


class _Handler(BaseHTTPRequestHandler):
    receiver: ReceiverServer  # set on the bound subclass
    server_version = "p2pweights-receiver"

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
        route = _ALL_ROUTES.get(parts.path)
        if route is None:
            return self._send(404, {"detail": "Not Found"})
        methods, verb = route
        if method not in methods:
            return self._send(405, {"detail": "Method Not Allowed"})
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        try:
            body = self._read_body()
            status, payload = getattr(self, "_do_" + verb)(body, query)
        except _BadRequest as e:
            status, payload = 400, {"object": "error", "message": str(e), "type": "Bad Request", "param": None,
                                    "code": 400}
        except _Conflict as e:
            status, payload = 400, {"success": False, "message": str(e)}
        except Exception as e:  # noqa: BLE001 - a hook failed: report it, keep serving
            logger.error("receiver hook for %s failed:\n%s", parts.path, traceback.format_exc())
            status, payload = 500, {"success": False, "message": f"{parts.path} failed in the engine: "
                                                                 f"{type(e).__name__}: {e}"}
        self._send(status, payload)

    def _read_body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        if not raw.strip():
            return {}
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise _BadRequest(f"the body is not JSON: {e}") from None
        if not isinstance(body, dict):
            raise _BadRequest("the body must be a JSON object")
        return body

    def _send(self, status: int, payload: Any) -> None:
        send_json(self, status, payload)

    # ---- one method per verb: (body, query) -> (status, payload) -----------------------------

    def _do_health(self, body: dict, query: dict) -> tuple[int, Any]:
        return 200, None

    def _do_server_info(self, body: dict, query: dict) -> tuple[int, Any]:
        return 200, self.receiver.hooks.server_info()

    def _do_model_info(self, body: dict, query: dict) -> tuple[int, Any]:
        return 200, self.receiver._model_info()

    def _do_remote_instance_transfer_engine_info(self, body: dict, query: dict) -> tuple[int, Any]:
        rank = _rank(query)
        if rank is None:
            return 400, {"error": {"message": "Missing or invalid rank parameter"}}
        info, extra = self.receiver._transfer_engine_info(rank)
        if info is None:
            return 400, {"error": {"message": f"Failed to get transfer engine info for rank {rank}"}}
        return 200, {"rank": rank, "remote_instance_transfer_engine_info": info, **extra}

    def _do_get_transfer_engine_info(self, body: dict, query: dict) -> tuple[int, Any]:
        rank = _rank(query)
        if rank is None:
            return 400, {"detail": "Invalid rank parameter"}
        info, extra = self.receiver._transfer_engine_info(rank)
        if info is None:
            return 404, {"detail": f"No transfer engine info for rank {rank}"}
        return 200, {"rank": rank, "remote_instance_transfer_engine_info": info, **extra}

    def _do_register_transfer_engine_info(self, body: dict, query: dict) -> tuple[int, Any]:
        try:
            rank = body["tp_rank"]
            info = body["transfer_engine_info"]
            session_id, weights_info = info["session_id"], info["weights_info_dict"]
        except (KeyError, TypeError) as e:
            return 400, {"detail": f"expected {{'tp_rank', 'transfer_engine_info': {{'session_id', "
                                   f"'weights_info_dict'}}}}, missing {e}"}
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            return 400, {"detail": f"tp_rank must be an integer >= 0, got {rank!r}"}
        extra = {k: v for k, v in info.items() if k not in ("session_id", "weights_info_dict")}
        self.receiver.register_transfer_engine_info(rank, session_id, weights_info, extra)
        return 200, "OK"

    def _do_pause_generation(self, body: dict, query: dict) -> tuple[int, Any]:
        return 200, self.receiver._pause(body)

    def _do_continue_generation(self, body: dict, query: dict) -> tuple[int, Any]:
        return 200, self.receiver._continue(body)

    def _do_begin_weight_update(self, body: dict, query: dict) -> tuple[int, Any]:
        return 200, self.receiver._begin(body)

    def _do_end_weight_update(self, body: dict, query: dict) -> tuple[int, Any]:
        return 200, self.receiver._end(body)

    def _do_update_weight_version(self, body: dict, query: dict) -> tuple[int, Any]:
        return 200, self.receiver._update_weight_version(body)

    def _do_weights_checker(self, body: dict, query: dict) -> tuple[int, Any]:
        return self.receiver._weights_checker(body)

    def _do_get_weights_by_name(self, body: dict, query: dict) -> tuple[int, Any]:
        return self.receiver._get_weights_by_name(body)

    def _do_init_weights_update_group(self, body: dict, query: dict) -> tuple[int, Any]:
        return self.receiver._init_weights_update_group(body)

    def _do_update_weights_from_distributed(self, body: dict, query: dict) -> tuple[int, Any]:
        return self.receiver._update_weights_from_distributed(body)

    def _do_destroy_weights_update_group(self, body: dict, query: dict) -> tuple[int, Any]:
        return self.receiver._destroy_weights_update_group(body)


def _rank(query: dict) -> int | None:
    try:
        rank = int(query["rank"])
    except (KeyError, ValueError):
        return None
    return rank if rank >= 0 else None


def register_transfer_engine_info(url: str, rank: int, session_id: str, weights_info: dict,
                                  timeout: float = 10.0, *, extra: dict | None = None) -> None:
    """Publish one rank's regions to an engine's server (a ReceiverServer, or sglang's bootstrap
    server on --engine-info-bootstrap-port): ``PUT /register_transfer_engine_info`` with sglang's body
    ``{"tp_rank", "transfer_engine_info": {"session_id", "weights_info_dict"}}``. ``extra`` keys go
    into ``transfer_engine_info`` too (a ReceiverServer publishes them; sglang ignores them)."""
    import http.client

    parts = urlsplit(url if "://" in url else "http://" + url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    body = json.dumps({"tp_rank": int(rank),
                       "transfer_engine_info": {**(extra or {}), "session_id": session_id,
                                                "weights_info_dict": weights_info}})
    try:
        conn.request("PUT", "/register_transfer_engine_info", body=body,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode("utf-8", "replace")
    except OSError as e:
        raise EngineError(f"cannot register rank {rank}'s transfer-engine info at {url}: {e}") from e
    finally:
        conn.close()
    if resp.status != 200:
        raise EngineError(f"registering rank {rank}'s transfer-engine info at {url} failed: "
                           f"HTTP {resp.status}: {text[:300]}")

