"""The control-plane protocol, written once: routes, request and answer bodies, status codes,
error payloads. The engine client (``control.sglang``) and the receiver's HTTP server
(``receiver.server``) both read it; no route, mode or status is spelled anywhere else.

The protocol is sglang 0.5.23's own HTTP API (``srt/entrypoints/http_server.py`` for the routes,
``srt/managers/io_struct.py`` for the bodies, ``srt/entrypoints/engine_info_bootstrap_server.py``
for the bootstrap routes); tests/test_engines_sglang_routes.py checks this table against the
installed sglang's source. What p2pweights adds is one error payload, understood by the client
and ignored by anything that reads sglang's ``{"success": false, "message": ...}``::

    {"success": false, "message": "<text>",
     "error": {"type": "<a p2pweights.errors class>", "message": "<text>",
               "engine": str | null, "rank": int | null, "parameter": str | null, "hint": str | null}}

The client raises the class named in ``type`` with those fields; an answer in one of sglang's own
error shapes becomes an ``EngineError``.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from .. import errors
from ..errors import EngineError, InvalidRequest, P2PWeightsError

PAUSE_MODES = ("abort", "retract", "in_place")   # sglang's PauseGenerationReqInput.mode
SELECTORS = ("target", "draft", "all")           # which weights a session or check covers (draft: EAGLE/MTP)

# ---- status codes ------------------------------------------------------------------------------

OK = 200
BAD_REQUEST = 400         # a malformed body, or a call out of order for the session (sglang's code for both)
UNAUTHORIZED = 401        # sglang's --api-key
FORBIDDEN = 403
NOT_FOUND = 404           # no such route; on the bootstrap server: that rank published nothing
METHOD_NOT_ALLOWED = 405
REQUEST_TIMEOUT = 408     # the client stalled while sending its request (receiver.http_guard)
CONFLICT = 409            # the engine's weight-update session is another controller's, or its weights are torn
PAYLOAD_TOO_LARGE = 413   # a body over the receiver's limit, refused unread
ENGINE_FAILED = 500       # a hook raised inside the engine; its state is unchanged
NOT_IMPLEMENTED = 501     # a receiver whose hooks do not implement one of p2pweights' own routes
SERVICE_UNAVAILABLE = 503  # /health while the engine starts


def ok(status: int) -> bool:
    return 200 <= status < 300


# what sglang's (and the receiver's) messages say, matched by the client
SESSION_ALREADY_OPEN = "already open"           # "a weight-update session is already open; ..."
NO_SESSION = "no weight-update session"
SEED_FLAG = "--remote-instance-weight-loader-start-seed-via-transfer-engine"

#: sessions with an owner (docs/protocol.md, "Sessions: owner and lease"): every call an update's
#: controller makes carries its owner id; begin and renew carry the lease it asks for, in seconds.
#: sglang ignores both headers.
SESSION_OWNER_HEADER = "X-P2PW-Session-Owner"
SESSION_LEASE_HEADER = "X-P2PW-Session-Lease"
TORN = "torn"                                   # what /health and /server_info say of torn weights

#: A receiver's begin answers ``END_FOLDS: true``: its end_weight_update may be asked, in its body's
#: ``END_THEN`` (``{"new_version": str, "continue": bool, "torch_empty_cache": bool}``), to bump the
#: version and continue generation right after it ended, in the same call; its answer then says what
#: each did under ``END_THEN`` (``{"update_weight_version": {"success", "message", ...}, ...}``).
#: One round trip instead of three; sglang's servers never get it (they do not answer END_FOLDS).
END_FOLDS = "p2pw_end_then"
END_THEN = "p2pw_then"
#: a receiver's answer to a session verb carries its own timings under this key (seconds by phase:
#: ``server_s``, its fan-outs to the ranks, each rank's, and a folded end's ``<verb>_s``)
TIMINGS_KEY = "p2pw_timings"

#: a receiver's leader reaches its other engine ranks at ``POST {RANK_ROUTE_PREFIX}<verb>`` (internal)
RANK_ROUTE_PREFIX = "/p2pw_rank/"


# ---- request bodies (sglang's io_struct classes, field for field) -------------------------------


def _choices(options: tuple[str, ...]) -> Any:
    return {"choices": options}


class Body:
    """A request or answer body. ``SGLANG`` names sglang's class of the same fields."""

    SGLANG: ClassVar[str | None] = None


@dataclass
class PauseGenerationReq(Body):
    SGLANG: ClassVar[str | None] = "PauseGenerationReqInput"
    mode: str = field(default="abort", metadata=_choices(PAUSE_MODES))


@dataclass
class ContinueGenerationReq(Body):
    SGLANG: ClassVar[str | None] = "ContinueGenerationReqInput"
    torch_empty_cache: bool = True


@dataclass
class BeginWeightUpdateReq(Body):
    SGLANG: ClassVar[str | None] = "BeginWeightUpdateReqInput"
    selector: str = field(default="all", metadata=_choices(SELECTORS))


@dataclass
class EndWeightUpdateReq(Body):
    """sglang's body is empty. ``extra`` carries p2pweights' ``p2pw_then`` (:data:`END_THEN`), sent
    only to an engine whose begin answered :data:`END_FOLDS` (a receiver; never to sglang)."""

    SGLANG: ClassVar[str | None] = "EndWeightUpdateReqInput"
    extra: dict = field(default_factory=dict, metadata={"extra": True})


@dataclass
class UpdateWeightVersionReq(Body):
    """sglang aborts running requests by default; p2pweights' client always sends false (the
    engine was paused before the writes)."""

    SGLANG: ClassVar[str | None] = "UpdateWeightVersionReqInput"
    new_version: str
    abort_all_requests: bool = True


@dataclass
class CheckWeightsReq(Body):
    """``extra``: fields sglang does not define (a receiver reads ``hf_seed`` for ``p2pw_compare``);
    sent and received flat, next to sglang's fields."""

    SGLANG: ClassVar[str | None] = "CheckWeightsReqInput"
    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list | None = None
    selector: str = field(default="all", metadata=_choices(SELECTORS))
    extra: dict = field(default_factory=dict, metadata={"extra": True})


@dataclass
class GetWeightsByNameReq(Body):
    SGLANG: ClassVar[str | None] = "GetWeightsByNameReqInput"
    name: str
    truncate_size: int = 100


@dataclass
class InitWeightsUpdateGroupReq(Body):
    SGLANG: ClassVar[str | None] = "InitWeightsUpdateGroupReqInput"
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "nccl"


@dataclass
class UpdateWeightsFromDistributedReq(Body):
    SGLANG: ClassVar[str | None] = "UpdateWeightsFromDistributedReqInput"
    names: list
    dtypes: list
    shapes: list
    group_name: str = "weight_update_group"
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    selector: str = field(default="all", metadata=_choices(SELECTORS))
    torch_empty_cache: bool = False

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise InvalidRequest("names, dtypes and shapes must have the same length")


@dataclass
class DestroyWeightsUpdateGroupReq(Body):
    SGLANG: ClassVar[str | None] = "DestroyWeightsUpdateGroupReqInput"
    group_name: str = "weight_update_group"


@dataclass
class RegisterTransferEngineInfoReq(Body):
    """The bootstrap server's ``PUT /register_transfer_engine_info`` (sglang parses it by hand):
    ``transfer_engine_info`` is ``{"session_id", "weights_info_dict", <extra publication keys>}``."""

    tp_rank: int
    transfer_engine_info: dict

    def __post_init__(self) -> None:
        if self.tp_rank < 0:
            raise InvalidRequest(f"field 'tp_rank' must be >= 0, got {self.tp_rank}")
        missing = [k for k in ("session_id", "weights_info_dict") if k not in self.transfer_engine_info]
        if missing:
            raise InvalidRequest(f"field 'transfer_engine_info' needs {', '.join(map(repr, missing))}")


@dataclass
class RenewWeightUpdateReq(Body):
    """p2pweights' ``POST /renew_weight_update`` (no sglang counterpart): the session's owner renews
    its lease; ``release``: the owner gives the session up (the engine is then torn until a complete
    update)."""

    release: bool = False


@dataclass
class WeightsDigestReq(Body):
    """p2pweights' ``POST /p2pw_weights_digest`` (no sglang counterpart; ``update(verify=True)``):
    ``names`` maps an engine rank (as a string) to the parameters whose bytes it digests. The answer:
    ``{"success": true, "algorithm": ..., "ranks": {"<rank>": {param: digest}}}`` (receiver.digest)."""

    names: dict = field(default_factory=dict)


# ---- answer bodies ---------------------------------------------------------------------------


@dataclass
class Ack(Body):
    """sglang's answer to the update verbs and the broadcast routes."""

    success: bool = True
    message: str = "Success"


@dataclass
class GenerationAck(Body):
    """sglang's answer to pause_generation / continue_generation."""

    message: str
    status: str = "ok"


@dataclass
class WeightVersionAck(Body):
    message: str
    new_version: str
    success: bool = True


@dataclass
class TransferEngineInfo(Body):
    """One engine rank's publication: sglang's ``[session_id, {param: [ptr, numel, elem_size]}]``
    (or the NIXL form), plus extra publication keys served flat next to it."""

    rank: int
    remote_instance_transfer_engine_info: Any
    extra: dict = field(default_factory=dict, metadata={"extra": True})


def encode(body: Body) -> dict:
    """The JSON object of a body: its fields (``None`` left out: sglang's default for each is
    None), ``extra`` flattened. Checks the fields first, as :func:`decode` does on the other side."""
    _check(body)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(body):
        v = getattr(body, f.name)
        if f.metadata.get("extra"):
            out = {**v, **out}
        elif v is not None:
            out[f.name] = v
    return out


def decode(cls: type, obj: Mapping[str, Any]) -> Any:
    """A body of class ``cls`` from a JSON object: sglang's defaults for missing (or null) fields,
    unknown fields ignored (or kept in ``extra``). Raises InvalidRequest naming the field."""
    if not isinstance(obj, Mapping):
        raise InvalidRequest("the body must be a JSON object")
    kwargs: dict[str, Any] = {}
    known = {f.name for f in dataclasses.fields(cls)}
    for f in dataclasses.fields(cls):
        if f.metadata.get("extra"):
            kwargs[f.name] = {k: v for k, v in obj.items() if k not in known}
        elif obj.get(f.name) is not None:
            kwargs[f.name] = obj[f.name]
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise InvalidRequest(f"field {f.name!r} is required")
    for name, v in kwargs.items():
        _check_field(cls, name, v)
    return cls(**kwargs)


def _check(body: Body) -> None:
    for f in dataclasses.fields(body):
        v = getattr(body, f.name)
        if v is not None and not f.metadata.get("extra"):
            _check_field(type(body), f.name, v)


def _check_field(cls: type, name: str, v: Any) -> None:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.metadata.get("extra"):
        return
    kind = _kind(typing.get_type_hints(cls)[name])
    if kind is not None and ((kind is int and isinstance(v, bool)) or not isinstance(v, kind)):
        raise InvalidRequest(f"field {name!r} must be {kind.__name__}, got {type(v).__name__}")
    choices = f.metadata.get("choices")
    if choices is not None and v not in choices:
        raise InvalidRequest(f"field {name!r} must be one of {', '.join(choices)}, got {v!r}")


def _kind(hint: Any) -> type | None:
    """The JSON type a field's annotation asks for (``str | None`` -> str); None: anything."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return _kind(inner[0]) if len(inner) == 1 else None
    origin = typing.get_origin(hint) or hint
    return origin if origin in (str, bool, int, float, list, dict) else None


# ---- the route table -------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """One route: ``verb`` is the client's name for it (an ``SglangEngine`` method), ``method`` what
    the client sends, ``methods`` what sglang and the receiver accept. ``called``: False for the
    older paths sglang still serves for the same verb (the receiver serves them; clients do not call
    them). ``query``: the query parameters it reads."""

    verb: str
    path: str
    method: str
    methods: tuple[str, ...]
    body: type | None = None
    query: tuple[str, ...] = ()
    health: bool = False
    bootstrap: bool = False
    called: bool = True
    p2pw: bool = False   # p2pweights' own route: a receiver serves it, sglang does not

    @property
    def sglang_body(self) -> str | None:
        return self.body.SGLANG if self.body is not None else None


_G, _P, _GP, _PUT = ("GET",), ("POST",), ("GET", "POST"), ("PUT",)

ROUTES: tuple[Route, ...] = (
    Route("health", "/health", "GET", _G, health=True),
    Route("health", "/health_generate", "GET", _G, health=True, called=False),
    Route("health", "/ready", "GET", _G, health=True, called=False),
    Route("server_info", "/server_info", "GET", _G),
    Route("server_info", "/get_server_info", "GET", _G, called=False),
    Route("model_info", "/model_info", "GET", _G),
    Route("model_info", "/get_model_info", "GET", _G, called=False),
    Route("remote_instance_transfer_engine_info", "/remote_instance_transfer_engine_info", "GET", _G,
          query=("rank",)),
    Route("remote_instance_transfer_engine_info", "/get_remote_instance_transfer_engine_info", "GET", _G,
          query=("rank",), called=False),
    Route("pause_generation", "/pause_generation", "POST", _P, PauseGenerationReq),
    Route("continue_generation", "/continue_generation", "POST", _P, ContinueGenerationReq),
    Route("begin_weight_update", "/begin_weight_update", "POST", _P, BeginWeightUpdateReq),
    Route("end_weight_update", "/end_weight_update", "POST", _P, EndWeightUpdateReq),
    Route("update_weight_version", "/update_weight_version", "POST", _P, UpdateWeightVersionReq),
    Route("weights_checker", "/weights_checker", "POST", _GP, CheckWeightsReq),
    Route("get_weights_by_name", "/get_weights_by_name", "POST", _GP, GetWeightsByNameReq),
    # the broadcast path (what RL frameworks use today; p2pweights.baseline.broadcast drives it)
    Route("init_weights_update_group", "/init_weights_update_group", "POST", _P, InitWeightsUpdateGroupReq),
    Route("update_weights_from_distributed", "/update_weights_from_distributed", "POST", _P,
          UpdateWeightsFromDistributedReq),
    Route("destroy_weights_update_group", "/destroy_weights_update_group", "POST", _P, DestroyWeightsUpdateGroupReq),
    # p2pweights' own (a receiver's): the session owner's lease
    Route("renew_weight_update", "/renew_weight_update", "POST", _P, RenewWeightUpdateReq, p2pw=True),
    # p2pweights' own: digests of what engine ranks hold, for update(verify=True)
    Route("p2pw_weights_digest", "/p2pw_weights_digest", "POST", _P, WeightsDigestReq, p2pw=True),
    # the engine-info bootstrap server's routes (--engine-info-bootstrap-port, default 6789); a
    # receiver serves them on its one port
    Route("get_transfer_engine_info", "/get_transfer_engine_info", "GET", _G, query=("rank",), bootstrap=True),
    Route("register_transfer_engine_info", "/register_transfer_engine_info", "PUT", _PUT,
          RegisterTransferEngineInfoReq, bootstrap=True),
)

#: path -> route: what a server serves
BY_PATH: dict[str, Route] = {r.path: r for r in ROUTES}
#: verb -> the route a client calls for it
BY_VERB: dict[str, Route] = {r.verb: r for r in ROUTES if r.called}
HEALTH_PATHS = frozenset(r.path for r in ROUTES if r.health)
BOOTSTRAP_PATHS = frozenset(r.path for r in ROUTES if r.bootstrap)
OWN_PATHS = frozenset(r.path for r in ROUTES if r.p2pw)  # p2pweights-only routes


def route(verb: str) -> Route:
    """The route a client calls for ``verb``."""
    try:
        return BY_VERB[verb]
    except KeyError:
        raise KeyError(f"{verb!r} is not a control-plane verb ({', '.join(BY_VERB)})") from None


# ---- error payloads --------------------------------------------------------------------------


def end_then(req: EndWeightUpdateReq) -> dict | None:
    """The checked :data:`END_THEN` of an end_weight_update body (``new_version``, ``continue``,
    ``torch_empty_cache``; the flags default to true), or None when the body has none."""
    then = req.extra.get(END_THEN)
    if then is None:
        return None
    if not isinstance(then, dict) or not isinstance(then.get("new_version"), str):
        raise InvalidRequest(f"field {END_THEN!r} must be an object with 'new_version' (a string), "
                             f"'continue' and 'torch_empty_cache' (booleans)")
    flags = {k: then.get(k, True) for k in ("continue", "torch_empty_cache")}
    if not all(isinstance(v, bool) for v in flags.values()):
        raise InvalidRequest(f"fields 'continue' and 'torch_empty_cache' of {END_THEN!r} must be booleans")
    return {"new_version": then["new_version"], **flags}


def error_payload(error: BaseException | str, *, type_name: str | None = None, **fields: Any) -> dict:
    """The one error answer of a receiver. A P2PWeightsError gives its own class and fields; any
    other exception (or text) is reported as ``type_name`` (default EngineError)."""
    if isinstance(error, P2PWeightsError):
        kind, message = type(error).__name__, error.message
        fields = {**error.fields(), **{k: v for k, v in fields.items() if v is not None}}
    else:
        kind, message = type_name or EngineError.__name__, str(error)
    detail = {"type": kind, "message": message}
    detail.update({k: fields.get(k) for k in errors.FIELDS})
    return {"success": False, "message": message, "error": detail}


@dataclass
class ErrorAnswer:
    """What an error answer says, whichever shape it came in (ours, or one of sglang's)."""

    type: str | None
    message: str
    fields: dict

    @classmethod
    def of(cls, answer: Any) -> "ErrorAnswer":
        if isinstance(answer, dict):
            err = answer.get("error")
            if isinstance(err, dict):  # ours, and sglang's {"error": {"message"}}
                return cls(err.get("type"), str(err.get("message", "")),
                           {k: err[k] for k in errors.FIELDS if err.get(k) is not None})
            for key in ("message", "detail"):  # sglang's {"success", "message"}; FastAPI's {"detail"}
                if isinstance(answer.get(key), str):
                    return cls(None, answer[key], {})
            return cls(None, _clip(json.dumps(answer)), {})
        return cls(None, _clip("" if answer is None else str(answer)), {})

    def exception(self, message: str, **fields: Any) -> P2PWeightsError:
        """The exception this answer names, with ``message``; ``fields`` fill what the answer left out."""
        cls = errors.error_named(self.type) if self.type else EngineError
        merged = {**{k: v for k, v in fields.items() if v is not None}, **self.fields}
        return cls(message, **merged)


def _clip(text: str, limit: int = 500) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def hint_for(verb: str, status: int, message: str) -> str:
    """What to do about an error answer to ``verb`` that carried no hint of its own."""
    if verb in ("remote_instance_transfer_engine_info", "get_transfer_engine_info") and status in (
            BAD_REQUEST, NOT_FOUND):
        return (f"is the engine started with {SEED_FLAG} and done loading? Its ranks publish their "
                f"weights to the engine-info bootstrap server (--engine-info-bootstrap-port, default 6789)")
    if status == NOT_FOUND:
        return ("the engine does not serve this route: p2pweights needs sglang 0.5.23's control endpoints "
                "(or a p2pweights.receiver server)")
    if status in (UNAUTHORIZED, FORBIDDEN):
        return "the engine requires an API key: pass api_key= (its --api-key or --admin-api-key)"
    if status == CONFLICT and TORN in message:
        return "only a complete update (begin, every write, end, version, continue) heals torn weights"
    if status == CONFLICT:
        return ("another controller owns this engine's weight-update session: wait for it to finish, or "
                "for its lease (P2PW_SESSION_LEASE) to expire")
    if verb == "begin_weight_update" and SESSION_ALREADY_OPEN in message:
        return ("a previous update left this engine's weight-update session open (it failed after the "
                "writes began); UpdateSession resumes such a session, or end it by hand")
    if verb == "end_weight_update" and NO_SESSION in message:
        return "call begin_weight_update first"
    if verb == "update_weight_version" and "session" in message:
        return "end the weight update before bumping the version"
    if status >= ENGINE_FAILED:
        return "the engine failed while handling the call; see its log"
    return ""
