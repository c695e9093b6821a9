"""An in-process ``sglang.Engine`` takes no p2pweights updates: the plugin says so, loudly, and every
sender that finds the engine's ranks refuses to connect (docs/sglang.md, "An in-process sglang.Engine").

Several RL frameworks run sglang as ``sglang.Engine(model_path=..., ...)`` in their own process and
drive it through its methods (``update_weights_from_tensor``, ``pause_generation``, ...). Such an engine
serves no HTTP: sglang never calls ``_setup_and_run_http_server``, where the plugin installs the session
gate, the digest route and the launcher's side of fencing (``sessions.py``, ``digest.py``,
``fencing.py``). A sender reaches an engine in two ways only: its URL (``SglangEngine(url)``: server
info and the session verbs, each carrying the owner's token) and one-sided writes into what its ranks
publish. An in-process engine has no URL the plugin could gate, and its methods carry no owner. So the
engine core's rules (owner, lease, epoch, torn) cannot hold there. Yet with sglang's seed flag its
ranks still publish their weights for one-sided writes. Hence a refusal, never fewer guarantees
in silence:

- **Detected** in the process that runs the Engine (kind ``main``). For the first Engine of a process,
  sglang's ``Engine.__init__`` is on the stack when it loads the plugins (:func:`engine_on_stack`). For
  every later one, a BEFORE hook on ``Engine.__init__`` runs (:func:`before_engine_init`).
- **Said.** One ERROR in the log when the engine's bootstrap server is built (its ranks are about to
  publish), naming why and what to do; a WARNING when the Engine starts. ``Engine.get_server_info()``
  carries ``p2pw_plugin`` with that ``error`` (an AFTER hook).
- **Refused at connect.** That process's engine-info bootstrap server, where every rank publishes,
  answers each rank's table with ``p2pw_refused`` (:data:`~p2pweights.transport.publication.REFUSED_KEY`):
  :class:`RefusedPublications`, joined to its app by an AFTER hook on the bootstrap module's
  ``fastapi_telemetry_disabled_kwargs``. A sender refuses such a publication
  (``EnginePublication.check_not_refused``: ``UnsupportedLayout`` naming the engine, the rank and why).
  sglang's own readers of the table (another instance seeding from this one) ignore the key.
"""
from __future__ import annotations

import inspect
import json
import logging
import sys
from typing import Any

from .. import __version__
from ..control import protocol as p
from ..control import routes
from ..front import asgi
from ..transport.publication import REFUSED_KEY
from . import bootstrap_key, server_info

logger = logging.getLogger(__name__)

ENGINE_MODULE = "sglang.srt.entrypoints.engine"
INIT_TARGET = f"{ENGINE_MODULE}.Engine.__init__"
SERVER_INFO_TARGET = f"{ENGINE_MODULE}.Engine.get_server_info"
APP_KWARGS_TARGET = "sglang.srt.entrypoints.engine_info_bootstrap_server.fastapi_telemetry_disabled_kwargs"
GET_PATH = routes.route("get_transfer_engine_info").path

WHY = ("sglang.Engine runs in this process (an in-process engine): it serves no HTTP, so the p2pweights plugin "
       "keeps no weight-update session here (no owner, lease, epoch fencing, torn state or digest), and p2pweights "
       "senders refuse its ranks' published weights. To take p2pweights updates, run the engine as a server "
       "(python -m sglang.launch_server, or sglang serve, with the same arguments as flags) and connect the "
       "sender to its URL")

#: why this process's engine is refused (None: no in-process Engine here)
REFUSED: str | None = None


def engine_on_stack() -> bool:
    """Whether sglang's ``Engine.__init__`` is running in this thread (it calls ``load_plugins()``)."""
    engine = getattr(sys.modules.get(ENGINE_MODULE), "Engine", None)
    init = getattr(inspect.unwrap(engine.__init__), "__code__", None) if engine is not None else None
    frame = sys._getframe(1)
    while init is not None and frame is not None:
        if frame.f_code is init:
            return True
        frame = frame.f_back
    return False


def refuse() -> None:
    """This process runs an in-process Engine: from now on its plugin refuses it (module docstring)."""
    global REFUSED
    if REFUSED is None:
        logger.warning("p2pweights sglang plugin: %s", WHY)
    REFUSED = WHY


def before_engine_init(*args: Any, **kwargs: Any) -> None:
    """BEFORE ``Engine.__init__`` (an Engine made after the plugins loaded): refused."""
    refuse()
    return None


def live() -> dict[str, Any]:
    """What ``Engine.get_server_info()`` says of the plugin (``server_info.after_build``)."""
    return {"offers": [], "error": REFUSED}


class RefusedPublications:
    """ASGI middleware on the bootstrap server's app: while this process's engine is refused, every
    rank's table it answers carries ``p2pw_refused``; every other request is sglang's."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if REFUSED is None or scope["type"] != "http" or scope.get("path") != GET_PATH or scope.get("method") != "GET":
            return await self.app(scope, receive, send)
        status, headers, body = await asgi.answer_of(self.app, scope, receive)
        if p.ok(status):
            try:
                answer = json.loads(body)
                if isinstance(answer, dict):
                    body = json.dumps({**answer, REFUSED_KEY: REFUSED}).encode()
            except ValueError:
                pass
        await asgi.respond(send, status, headers, body)


def after_app_kwargs(result: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER the bootstrap server's ``fastapi_telemetry_disabled_kwargs`` (its app, built inside
    ``Engine.__init__``): in a refused process, :class:`RefusedPublications` joins the app."""
    if REFUSED is None or not isinstance(result, dict):
        return result
    from starlette.middleware import Middleware

    logger.error("p2pweights sglang plugin: this in-process engine's ranks publish their weights for one-sided "
                 "writes at its engine-info bootstrap server, marked refused (%s): %s", REFUSED_KEY, REFUSED)
    return {**result, "middleware": [*result.get("middleware", ()), Middleware(RefusedPublications)]}


def register(kind: str) -> None:
    """The hooks of the process that may run an Engine (``main``); in a launcher they never fire."""
    if kind != "main":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if engine_on_stack():  # the first Engine of this process loads the plugins: no hook on it can run
        refuse()
    HookRegistry.register(INIT_TARGET, before_engine_init, HookType.BEFORE)
    HookRegistry.register(APP_KWARGS_TARGET, after_app_kwargs, HookType.AFTER)
    HookRegistry.register(SERVER_INFO_TARGET, server_info.after_build(
        __version__, None, server_info.combined(bootstrap_key.live, live)), HookType.AFTER)
