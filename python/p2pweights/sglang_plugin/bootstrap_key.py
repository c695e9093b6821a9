"""The server's API key on sglang's engine-info bootstrap server (``--engine-info-bootstrap-port``,
default 6789). docs/sglang.md, "The bootstrap server's key".

sglang's bootstrap server has no key. Anyone who reaches its port can read a rank's weights table,
which is the map of the rank's registered memory. Anyone can also overwrite it
(``PUT /register_transfer_engine_info``) and so send the next sender's writes elsewhere. With the
plugin, on a server started with ``--api-key`` or ``--admin-api-key``, :class:`KeyGuard` decides
every call by sglang's own rule for its ``ADMIN_OPTIONAL`` routes (``sglang.srt.utils.auth.
decide_request_auth``: the admin key when one is set, else the API key; ``/health`` stays open).
This is the same key as for the HTTP server's ``/remote_instance_transfer_engine_info``, which reads
the same table. A call without the key gets sglang's own 401 ``{"error": "Unauthorized"}``.

**Installing the guard.** sglang builds the bootstrap server's FastAPI app and starts serving it in
a thread, all inside ``EngineInfoBootstrapServer.__init__``; no attribute holds the app before it
serves. So an AROUND hook on that ``__init__`` marks the construction in this thread. While it is
marked, an AFTER hook on ``fastapi_telemetry_disabled_kwargs`` (the keyword arguments sglang passes
to that ``FastAPI(...)``) adds the guard as ``middleware=``. The guard is in the app from its first
request.

**sglang's own callers carry the key.** Both call the bootstrap server with ``requests`` and no
header, and both are scoped by a hook on sglang's side:
- each rank's ``RemoteInstanceWeightTransporter._register_to_engine_info_bootstrap`` (the PUT, in
  the scheduler processes, on any node): an AROUND hook;
- the HTTP server's proxy ``/remote_instance_transfer_engine_info`` (the GET, in the launcher): a
  middleware on sglang's app, inside sglang's key check, so only calls sglang admitted reach it.
Within those scopes, and only for the bootstrap routes' paths, the plugin's one AROUND hook on
``requests``' ``Session.request`` (``bootstrap_requests.py``) adds ``Authorization: Bearer <key>``.
Nowhere else does it change a request.

Not covered: with several HTTP workers (``--tokenizer-worker-num > 1``) the proxy runs in worker
processes that load no plugin. There the GET stays open, so that the proxy keeps working, and the
log warns.
"""
from __future__ import annotations

import contextvars
import logging
from dataclasses import dataclass
from typing import Any, Callable

from ..control import routes
from ..control.protocol import PLUGIN_BOOTSTRAP_KEY as OFFER
from ..front import asgi
from . import bootstrap_requests

logger = logging.getLogger(__name__)

_BOOTSTRAP_MODULE = "sglang.srt.entrypoints.engine_info_bootstrap_server"
SERVER_TARGET = f"{_BOOTSTRAP_MODULE}.EngineInfoBootstrapServer.__init__"
APP_KWARGS_TARGET = f"{_BOOTSTRAP_MODULE}.fastapi_telemetry_disabled_kwargs"
RANK_TARGET = ("sglang.srt.model_executor.model_runner_components.remote_instance_weight_transporter."
               "RemoteInstanceWeightTransporter._register_to_engine_info_bootstrap")
HTTP_SERVER_TARGET = "sglang.srt.entrypoints.http_server._setup_and_run_http_server"
REQUESTS_TARGET = bootstrap_requests.TARGET

#: the HTTP server's routes that proxy a GET to the bootstrap server
PROXY_PATHS = frozenset(r.path for r in routes.ROUTES if r.verb == "remote_instance_transfer_engine_info")
_READS = frozenset({"GET", "HEAD"})


@dataclass(frozen=True)
class Keys:
    """The server's ``--api-key`` and ``--admin-api-key``."""

    api_key: str | None
    admin_api_key: str | None

    @property
    def caller_key(self) -> str | None:
        """What an ``ADMIN_OPTIONAL`` route accepts: the admin key when set, else the API key."""
        return self.admin_api_key or self.api_key


def server_keys() -> Keys | None:
    """This server's keys (sglang's published serving args); None when it has none."""
    from sglang.srt.runtime_context import get_serving

    serving = get_serving()
    keys = Keys(serving.api_key or None, serving.admin_api_key or None)
    return keys if keys.caller_key else None


class KeyGuard:
    """ASGI middleware on the bootstrap server's app: sglang's ``ADMIN_OPTIONAL`` decision for each
    call whose method is not in ``open_methods``; a refused call gets sglang's own answer."""

    def __init__(self, app: Any, *, keys: Keys, open_methods: frozenset[str] = frozenset()):
        self.app, self.keys, self.open_methods = app, keys, open_methods

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] not in self.open_methods:
            from sglang.srt.utils.auth import AuthLevel, decide_request_auth
            from starlette.datastructures import Headers
            from starlette.responses import JSONResponse

            decision = decide_request_auth(
                method=scope["method"], path=asgi.route_path(scope),
                authorization_header=Headers(scope=scope).get("authorization"),
                api_key=self.keys.api_key, admin_api_key=self.keys.admin_api_key,
                auth_level=AuthLevel.ADMIN_OPTIONAL)
            if not decision.allowed:
                said = "Unauthorized" if decision.error_status_code == 401 else "Forbidden"
                return await JSONResponse({"error": said}, status_code=decision.error_status_code)(scope, receive, send)
        await self.app(scope, receive, send)


@dataclass
class _Building:
    """The bootstrap server's construction in progress (this thread), and whether the guard went in."""

    keys: Keys
    open_methods: frozenset[str]
    applied: bool = False


@dataclass
class _Carry:
    """A scope in which requests to the bootstrap routes carry ``key``; ``used``: one did."""

    key: str
    used: bool = False


_BUILDING: contextvars.ContextVar[_Building | None] = contextvars.ContextVar("p2pw_bootstrap_building", default=None)
_CARRY: contextvars.ContextVar[_Carry | None] = contextvars.ContextVar("p2pw_bootstrap_key", default=None)

# In the launcher: the guard on this process's bootstrap server (None: unguarded), and why it is not.
GUARDED: _Building | None = None
REFUSED: str | None = None


def around_server_init(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The AROUND hook on ``EngineInfoBootstrapServer.__init__``: sglang builds and starts its server,
    with :class:`KeyGuard` in the app when this server has a key."""
    global GUARDED, REFUSED
    keys = server_keys()
    if keys is None:  # no key: sglang's open server, as without the plugin
        return original(*args, **kwargs)
    building = _Building(keys, _open_methods())
    token = _BUILDING.set(building)
    try:
        result = original(*args, **kwargs)
    finally:
        _BUILDING.reset(token)
    if building.applied:
        GUARDED, REFUSED = building, None
        logger.info("p2pweights sglang plugin: the engine-info bootstrap server requires the server's key")
    else:
        REFUSED = (f"the engine-info bootstrap server runs without the key: sglang built its app without "
                   f"{APP_KWARGS_TARGET.rsplit('.', 1)[1]}()")
        logger.error("p2pweights sglang plugin: %s", REFUSED)
    return result


def _open_methods() -> frozenset[str]:
    from sglang.srt.runtime_context import get_serving

    workers = int(getattr(get_serving(), "tokenizer_worker_num", 1) or 1)
    if workers == 1:
        return frozenset()
    logger.warning("p2pweights sglang plugin: the engine-info bootstrap server requires the key to publish "
                   "weights (PUT) but not to read them (GET): this server runs %d HTTP workers, whose "
                   "/remote_instance_transfer_engine_info could not send it", workers)
    return _READS


def after_app_kwargs(result: Any, *args: Any, **kwargs: Any) -> Any:
    """The AFTER hook on ``fastapi_telemetry_disabled_kwargs``: while the bootstrap server is being
    built (:func:`around_server_init`, this thread), the guard joins the app's middleware. Elsewhere
    (sglang's other apps) the keyword arguments are left as they are."""
    building = _BUILDING.get()
    if building is None or building.applied or not isinstance(result, dict):
        return result
    from starlette.middleware import Middleware

    building.applied = True
    guard = Middleware(KeyGuard, keys=building.keys, open_methods=building.open_methods)
    return {**result, "middleware": [*result.get("middleware", ()), guard]}


def around_rank_registration(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The AROUND hook on a rank's ``_register_to_engine_info_bootstrap``: its PUT carries the key."""
    keys = server_keys()
    if keys is None:
        return original(*args, **kwargs)
    carry = _Carry(keys.caller_key)
    token = _CARRY.set(carry)
    try:
        return original(*args, **kwargs)
    finally:
        _CARRY.reset(token)
        if not carry.used:  # sglang stopped sending it through requests: the guard refuses it
            logger.error("p2pweights sglang plugin: this rank published its weights at the engine-info bootstrap "
                         "server without the key (sglang's registration no longer goes through requests)")


def before_http_server(*args: Any, **kwargs: Any) -> None:
    """The BEFORE hook on ``_setup_and_run_http_server``: sglang's proxy routes' GET carries the key
    when this process's bootstrap server requires it on reads. Never raises."""
    if GUARDED is None or "GET" in GUARDED.open_methods:
        return None
    try:
        from sglang.srt.entrypoints import http_server

        http_server.app.add_middleware(ProxyCarriesKey, key=GUARDED.keys.caller_key)
    except Exception as e:  # noqa: BLE001 - sglang must start either way; the reason is loud
        global REFUSED
        REFUSED = f"/remote_instance_transfer_engine_info cannot read the keyed bootstrap server: {type(e).__name__}: {e}"
        logger.error("p2pweights sglang plugin: %s", REFUSED)
    return None


class ProxyCarriesKey:
    """ASGI middleware on sglang's HTTP app: a call of a proxy route (:data:`PROXY_PATHS`; sglang's key
    check, outermost, admitted it) runs where the bootstrap GET it makes carries the key."""

    def __init__(self, app: Any, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or asgi.route_path(scope) not in PROXY_PATHS:
            return await self.app(scope, receive, send)
        token = _CARRY.set(_Carry(self.key))
        try:
            await self.app(scope, receive, send)
        finally:
            _CARRY.reset(token)


def _key_header(carry: _Carry) -> dict[str, str]:
    """What a request to a bootstrap route's path gets inside ``carry``'s scope (``bootstrap_requests``)."""
    carry.used = True
    return {"Authorization": f"Bearer {carry.key}"}


bootstrap_requests.add_headers(_CARRY, _key_header)


def live() -> dict[str, Any]:
    """What ``/server_info`` says (``server_info.after_build``): ``offers`` (``["bootstrap_key"]`` while
    this process's bootstrap server requires the key), ``error`` (why it runs without)."""
    return {"offers": [OFFER] if GUARDED is not None else [], "error": REFUSED}


def register(kind: str) -> None:
    """Register the hooks of a process of ``kind`` (``sglang_plugin.process_kind``): the guard and the
    proxy's key in the launcher (``main``), the rank's key in a scheduler, the key on requests in both."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if kind == "main":
        HookRegistry.register(SERVER_TARGET, around_server_init, HookType.AROUND)
        HookRegistry.register(APP_KWARGS_TARGET, after_app_kwargs, HookType.AFTER)
        HookRegistry.register(HTTP_SERVER_TARGET, before_http_server, HookType.BEFORE)
    elif kind == "scheduler":
        HookRegistry.register(RANK_TARGET, around_rank_registration, HookType.AROUND)
    if kind in ("main", "scheduler"):
        bootstrap_requests.register()
