"""Delta updates in a real sglang server, the launcher's side (docs/deltas.md, docs/sglang.md
"Deltas"); each rank's side is ``rank_deltas.py``.

- **The publication.** sglang's engine-info bootstrap server keeps only ``(session_id, weights)`` per
  rank. :class:`AreaBook`, an ASGI middleware joined to its app while sglang builds it (an AROUND hook
  on ``EngineInfoBootstrapServer.__init__`` marks the construction, an AFTER hook on
  ``fastapi_telemetry_disabled_kwargs`` adds it, as ``bootstrap_key.py`` adds its guard), keeps the
  ``delta_area`` a rank's PUT carries once sglang accepted the PUT, and adds it to that rank's GET
  answer (which the HTTP server's ``/remote_instance_transfer_engine_info`` proxy passes on as is). It
  keeps the rank's ``epoch`` the same way (``rank_epochs.py``, ``fencing.py``).
- **The apply.** The engine core (``engine/core.py``, through the session gate ``sessions.py``)
  keeps the committed base and decides; :func:`apply` is its step: every rank applies its own
  manifest (the weight checker's communicator, the action ``rank_deltas.ACTION``).
"""
from __future__ import annotations

import contextvars
import json
import logging
from typing import Any, Callable

from ..control import protocol as p
from ..control import routes
from ..front import asgi
from . import rank_deltas, version_guard

logger = logging.getLogger(__name__)

_BOOTSTRAP_MODULE = "sglang.srt.entrypoints.engine_info_bootstrap_server"
SERVER_TARGET = f"{_BOOTSTRAP_MODULE}.EngineInfoBootstrapServer.__init__"
APP_KWARGS_TARGET = f"{_BOOTSTRAP_MODULE}.fastapi_telemetry_disabled_kwargs"
HTTP_SERVER_TARGET = "sglang.srt.entrypoints.http_server._setup_and_run_http_server"
GET_PATH = routes.route("get_transfer_engine_info").path
OFFER = p.PLUGIN_DELTAS

_BUILDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("p2pw_delta_building", default=None)

# The launcher's state: the areas the ranks published (tp_rank -> [addr, nbytes]); the sglang
# handles the apply needs (set by the BEFORE hook); why deltas are not offered.
AREAS: dict[int, list[int]] = {}
EPOCHS: dict[int, int] = {}  # the registration epoch each rank's last accepted PUT carried (fencing.py)
EPOCH_KEY = rank_deltas.EPOCH_KEY
TOKENIZER: Any = None
TP_SIZE = 0
REFUSED: str | None = None


class AreaBook:
    """ASGI middleware on the bootstrap server's app: keeps and serves each rank's ``delta_area`` and ``epoch``."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "") if scope["type"] == "http" else ""
        if path == rank_deltas.REGISTER_PATH and scope.get("method") == "PUT":
            return await self._register(scope, receive, send)
        if path == GET_PATH and scope.get("method") == "GET":
            return await self._serve(scope, receive, send)
        return await self.app(scope, receive, send)

    async def _register(self, scope: dict, receive: Any, send: Any) -> None:
        raw = await asgi.read_body(receive)
        status = await self._forward(scope, asgi.replay(raw), send)
        try:
            data = json.loads(raw)
            area, rank, epoch = data.get(rank_deltas.AREA_KEY), data.get("tp_rank"), data.get(EPOCH_KEY)
        except (ValueError, AttributeError):
            return
        if p.ok(status) and isinstance(rank, int) and isinstance(area, list) and len(area) == 2:
            AREAS[rank] = [int(area[0]), int(area[1])]
        if p.ok(status) and isinstance(rank, int):  # a session without an epoch is not revocable
            if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch > 0:
                EPOCHS[rank] = epoch
            else:
                EPOCHS.pop(rank, None)

    async def _forward(self, scope: dict, receive: Any, send: Any) -> int:
        status = [0]

        async def seen(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        await self.app(scope, receive, seen)
        return status[0]

    async def _serve(self, scope: dict, receive: Any, send: Any) -> None:
        status, headers, body = await asgi.answer_of(self.app, scope, receive)
        if p.ok(status):
            try:
                answer = json.loads(body)
                rank = int(answer.get("rank"))
                keys = {rank_deltas.AREA_KEY: AREAS.get(rank), EPOCH_KEY: EPOCHS.get(rank)}
                if any(v is not None for v in keys.values()):
                    body = json.dumps({**answer, **{k: v for k, v in keys.items() if v is not None}}).encode()
            except (ValueError, TypeError, AttributeError):
                pass
        await asgi.respond(send, status, headers, body)


def around_server_init(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    token = _BUILDING.set([False])
    try:
        return original(*args, **kwargs)
    finally:
        _BUILDING.reset(token)


def after_app_kwargs(result: Any, *args: Any, **kwargs: Any) -> Any:
    building = _BUILDING.get()
    if building is None or building[0] or not isinstance(result, dict):
        return result
    from starlette.middleware import Middleware

    building[0] = True
    return {**result, "middleware": [*result.get("middleware", ()), Middleware(AreaBook)]}


def before_http_server(*args: Any, **kwargs: Any) -> None:
    """BEFORE ``_setup_and_run_http_server``: the tokenizer manager the apply goes through. Never raises."""
    global TOKENIZER, TP_SIZE, REFUSED
    try:
        bound = {**dict(zip(version_guard.HOOKED[HTTP_SERVER_TARGET], args)), **kwargs}
        server_args = bound["server_args"]
        if int(server_args.dp_size) != 1 or int(server_args.pp_size) != 1:
            REFUSED = "deltas not taken: data and pipeline parallelism are not covered"
        elif not hasattr(bound["tokenizer_manager"], "check_weights_communicator"):
            REFUSED = "deltas not taken: sglang's tokenizer manager has no check_weights_communicator"
        else:
            TOKENIZER, TP_SIZE = bound["tokenizer_manager"], int(server_args.tp_size)
    except Exception as e:  # noqa: BLE001 - sglang must start either way
        REFUSED = f"deltas not taken: {type(e).__name__}: {e}"
    if REFUSED:
        logger.error("p2pweights sglang plugin: %s", REFUSED)
    return None


def support() -> str:
    """Why this engine cannot take deltas now ("" when it can): every TP rank must publish an area."""
    if TOKENIZER is None:
        return REFUSED or "deltas not taken: the plugin's hooks did not run in this server"
    missing = sorted(set(range(TP_SIZE)) - set(AREAS))
    return f"engine rank(s) {missing} publish no delta area (weights on a GPU take full writes)" if missing else ""


def live() -> dict[str, Any]:
    """What ``/server_info`` says of deltas (``server_info.after_build``)."""
    return {"offers": [OFFER] if TOKENIZER is not None else [], "error": REFUSED}


async def apply(manifests: dict[str, dict]) -> str:
    """Every rank applies its manifest; "" when all did, else why the apply was refused."""
    TOKENIZER.auto_create_handle_loop()
    outputs = await TOKENIZER.check_weights_communicator(rank_deltas.apply_request(manifests))
    for out in outputs:
        if not out.success:
            try:
                detail = json.loads(out.message)[rank_deltas.ERROR_KEY]
                return f"{detail.get('type')}: {detail.get('message')}"
            except (ValueError, TypeError, KeyError):
                return f"the schedulers did not apply the deltas: {out.message!r}"
    return ""


def register(kind: str) -> None:
    """The launcher's hooks (``main``); a scheduler's are ``rank_deltas.register``."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if kind == "main":
        HookRegistry.register(SERVER_TARGET, around_server_init, HookType.AROUND)
        HookRegistry.register(APP_KWARGS_TARGET, after_app_kwargs, HookType.AFTER)
        HookRegistry.register(HTTP_SERVER_TARGET, before_http_server, HookType.BEFORE)
    elif kind == "scheduler":
        rank_deltas.register()
