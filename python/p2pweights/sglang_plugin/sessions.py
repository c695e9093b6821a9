"""The sglang plugin's host of the engine core (``engine/core.py``): weight-update sessions with
owners, engine-bounded leases, epochs, the torn state and the delta base, decided by the core and
kept inside a real sglang server's HTTP process. docs/sglang.md, "Sessions".

Where: a BEFORE hook on sglang's ``sglang.srt.entrypoints.http_server._setup_and_run_http_server``,
which the launcher calls once the engine's subprocesses run, just before uvicorn serves sglang's
FastAPI ``app``. The hook (:func:`before_http_server`) adds to that ``app`` p2pweights' own routes
(``/renew_weight_update``, ``/p2pw_apply_deltas``), marked ``ADMIN_OPTIONAL`` like sglang's control
routes so that sglang's key middleware applies its own ``--api-key`` / ``--admin-api-key`` rules to
them, and :class:`SessionGate`, an ASGI middleware in front of sglang's routes. sglang adds its key
middleware after this hook ran, so the key check wraps the gate.

What this module does is map, and nothing more:
- sglang's routes onto the core's verbs (:data:`GATED_PATHS`; ``/weights_checker`` by its action:
  ``reset_tensors`` is a write of the weights, the plugin's own ``p2pw_*`` actions are refused from
  outside: they are the gate's channel into the ranks);
- the core's steps onto sglang: pause state from the tokenizer manager, sglang's own routes through
  its app, the ranks' delta apply, revocation and an adapter's slot through the weight checker's
  communicator (``delta_updates.py``, ``fencing.py``, ``lora_slots.py``), sglang's "already open" answer
  read as its own session open. An adapter session's begin and end (the core's body names the adapter)
  run none of sglang's weight-update work (its restore before loading, its post-processing): an
  adapter's slot needs none, as after sglang's own adapter load. A pinned ``/load_lora_adapter``
  answers the slot the ranks placed the adapter in (``p2pw_slot``, as a receiver answers).

Not covered: a server with several HTTP workers (``--tokenizer-worker-num > 1``: each would keep its
own session; the plugin offers no sessions there, and says why), the native gRPC server, and the
engine's other processes (a scheduler obeys whatever reaches it).
"""
from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from ..control import bodies, routes
from ..control import protocol as p
from ..engine import core as ec
from ..engine import steps
from ..engine.adapters import ADAPTER_KEY, LOAD_ADAPTER
from ..errors import InvalidRequest, InvalidWrite
from ..front import answer_for, asgi
from ..front.verb_answers import respond_verb
from . import delta_updates, fencing, lora_slots, version_guard

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.entrypoints.http_server._setup_and_run_http_server"
OFFER = "sessions"  # what p2pw_plugin.offers lists while the gate is installed

RENEW_PATH, APPLY_PATH = routes.route(ec.RENEW).path, routes.route(ec.APPLY).path
CHECKER_PATH = routes.route("weights_checker").path
BODY_LIMIT = 32 << 20  # the largest body a gated route takes (413 above it)

#: sglang's routes (and the plugin's own) -> the engine core's verb: the receiver's verbs that sglang
#: serves, and sglang's other routes that write the weights or free and restore their memory
GATED_PATHS: dict[str, str] = {
    **{r.path: r.verb for r in routes.ROUTES if r.verb in ec.VERBS and not r.p2pw},
    RENEW_PATH: ec.RENEW,
    APPLY_PATH: ec.APPLY,
    **{f"/{verb}": verb for verb in ("update_weights_from_tensor", "update_weights_from_disk",
                                     "update_weights_from_ipc", "release_memory_occupation",
                                     "resume_memory_occupation")},
}
#: the weight checker's actions that write the weights (the core's verb), and the plugin's own
#: actions (the gate's channel into the ranks: never accepted from outside)
CHECKER_WRITES = {"reset_tensors": "reset_weights"}
OWN_ACTIONS = "p2pw_"


class SglangSessionHost:
    """The HTTP process's one engine core (``lease``: the longest it grants, default
    ``P2PW_SESSION_LEASE`` in the server's environment) and the tokenizer manager its steps reach
    sglang's ranks through."""

    def __init__(self, engine: str, lease: float | None = None, tokenizer: Any = None):
        self.core = ec.EngineCore(engine, lease)
        self.session = self.core.session
        self.tokenizer = tokenizer


# The HTTP process's host once installed; why sessions are not offered when they could not be.
HOST: SglangSessionHost | None = None
REFUSED: str | None = None


def before_http_server(*args: Any, **kwargs: Any) -> None:
    """The BEFORE hook: install the gate and the plugin's routes on sglang's ``app`` before it serves.
    Never raises (a failure is logged at ERROR and reported in ``p2pw_plugin.error``); leaves sglang's
    arguments as they are."""
    from sglang.srt.entrypoints import http_server
    from sglang.srt.runtime_context import get_serving

    serving = get_serving()
    try:
        bound = {**dict(zip(version_guard.HOOKED[TARGET], args)), **kwargs}
        install(http_server.app, workers=int(serving.tokenizer_worker_num),
                engine=f"http://{serving.host}:{serving.port}", tokenizer=bound.get("tokenizer_manager"))
    except Exception as e:  # noqa: BLE001 - sglang must start either way; the refusal is loud
        refuse(f"sessions not installed: {type(e).__name__}: {e}")
    return None


def install(app: Any, *, workers: int = 1, engine: str = "engine", lease: float | None = None,
            tokenizer: Any = None) -> SglangSessionHost | None:
    """Add the plugin's routes and :class:`SessionGate` to sglang's FastAPI ``app`` (before it serves).
    Refuses (None, logged, :data:`REFUSED`) where one session cannot be kept: several HTTP workers,
    no tokenizer manager to ask whether generation is paused, or an app that lacks a gated route
    (sglang's routes changed)."""
    global HOST
    if workers != 1:
        return refuse(f"sessions need one HTTP process; this server runs {workers} (--tokenizer-worker-num), each "
                      f"would keep its own session")
    if tokenizer is None or not hasattr(tokenizer, "is_pause"):
        return refuse("sessions not installed: sglang's tokenizer manager (its is_pause) was not found")
    served = {getattr(r, "path", None) for r in app.router.routes}
    missing = sorted(set(GATED_PATHS) - {RENEW_PATH, APPLY_PATH} - served)
    if missing:
        return refuse(f"sessions not installed: this sglang serves no {', '.join(missing)}")
    taken = sorted({RENEW_PATH, APPLY_PATH} & served)
    if taken:
        return refuse(f"sessions not installed: {', '.join(taken)} is served already (by another plugin?)")
    host = SglangSessionHost(engine, lease, tokenizer)
    for path in (RENEW_PATH, APPLY_PATH):
        app.add_api_route(path, _answered_by_the_gate(), methods=["POST"])
    app.add_middleware(SessionGate, host=host)
    HOST = host
    return host


def refuse(why: str) -> None:
    global REFUSED
    REFUSED = why
    logger.error("p2pweights sglang plugin: %s", why)  # ERROR reaches the server's log
    return None


def live() -> dict[str, Any]:
    """What ``/server_info`` says of sessions now (``server_info.after_build``): ``offers`` (``["sessions"]``
    while the gate is installed), ``error`` (why it is not), ``weight_update`` (the session's state,
    as a receiver reports it in ``p2pw_weight_update``; None without a gate)."""
    if HOST is None:
        return {"offers": [], "error": REFUSED, "weight_update": None}
    return {"offers": [OFFER], "error": None, "weight_update": HOST.core.state()}


def _answered_by_the_gate() -> Any:
    """The endpoint of a route the gate answers itself: there so that sglang's key middleware finds
    the route and applies its admin rules (``ADMIN_OPTIONAL``, as sglang's control routes); reached
    only if the gate is not in front of it."""
    from sglang.srt.utils.auth import AuthLevel, auth_level

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def p2pw_session_route(request: Request) -> JSONResponse:
        status, payload = answer_for(InvalidRequest("the p2pweights session gate is not installed"), request.url.path)
        return JSONResponse(payload, status_code=status)

    return p2pw_session_route


class SessionGate:
    """ASGI middleware: each call of a gated route as a verb of the engine core (module docstring)."""

    def __init__(self, app: Any, host: SglangSessionHost):
        self.app, self.host = app, host

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = asgi.route_path(scope) if scope["type"] == "http" else ""
        if path not in GATED_PATHS and path != CHECKER_PATH:
            return await self.app(scope, receive, send)
        try:
            raw = await asgi.read_body(receive, BODY_LIMIT)
        except ValueError as e:
            return await asgi.respond_json(send, p.PAYLOAD_TOO_LARGE, answer_for(InvalidRequest(str(e)))[1])
        body = asgi.decode(raw)

        async def run() -> Any:
            verb = self._verb(path, body)
            if verb is None:  # a read of the weight checker (a checksum, a compare): anyone's
                return await self.app(scope, asgi.replay(raw), send)
            return await self.host.core.run_async(verb, asgi.Headers(scope), body if isinstance(body, dict) else None,
                                                  lambda step: self._step(step, scope, raw))

        await respond_verb(send, path, run)

    @staticmethod
    def _verb(path: str, body: Any) -> str | None:
        if path != CHECKER_PATH:
            return GATED_PATHS[path]
        action = body.get("action") if isinstance(body, dict) else None
        if isinstance(action, str) and action.startswith(OWN_ACTIONS):
            raise InvalidRequest(f"{CHECKER_PATH} refused: the action {action[:40]!r} is the p2pweights gate's own "
                                 f"channel into the ranks")
        return CHECKER_WRITES.get(action) if isinstance(action, str) else None

    async def _step(self, step: steps.Step, scope: dict, raw: bytes) -> Any:
        """One step of the core, done the sglang way."""
        if isinstance(step, steps.IsPaused):
            return bool(self.host.tokenizer.is_pause)
        if isinstance(step, steps.DeltaSupport):
            return delta_updates.support()
        if isinstance(step, steps.PublishedEpochs):
            return list(delta_updates.EPOCHS.values())
        if isinstance(step, steps.Revoke):
            return await fencing.revoke(step.epoch, self.host.core.engine)
        if isinstance(step, steps.ApplyDeltas):
            return await _apply(step.manifests)
        if isinstance(step, steps.AdapterSlot):
            return await lora_slots.slot(self.host.tokenizer, step.name, self.host.core.engine)
        if isinstance(step, steps.End):
            if _adapter(step.body):  # an adapter's slot needs none of sglang's post-processing of the weights
                return _adapter_ack(step.manifests)
            if step.manifests is not None:  # the deltas first, then sglang's post-processing
                await _apply(step.manifests)
            return await self._sglang(scope, ec.END, step.body)
        if step.verb == ec.RENEW:
            return steps.Answer(p.OK, {})
        if step.verb == ec.BEGIN and _adapter(step.body):  # nor sglang's restore of the weights before loading
            return _adapter_ack(None)
        if step.verb in CHECKER_WRITES.values():
            return await self._sglang(scope, None, None, raw)
        answer = await self._sglang(scope, step.verb, step.body)
        if step.verb == LOAD_ADAPTER and answer.ok and isinstance(step.body, dict) and step.body.get("pinned"):
            answer = await self._placed(answer, step.body.get("lora_name"))
        return answer

    async def _placed(self, answer: steps.Answer, name: Any) -> steps.Answer:
        """sglang's answer to a pinned load, with the slot its ranks gave the adapter (``p2pw_slot``, as a
        receiver answers): placed now, so the first update finds it resident; sglang's answer as it is
        when it cannot be placed (the update's begin then says why)."""
        try:
            slot = await lora_slots.slot(self.host.tokenizer, str(name), self.host.core.engine)
        except Exception as e:  # noqa: BLE001 - the load itself succeeded
            logger.warning("p2pweights sglang plugin: LoRA adapter %r loaded but not placed: %s", name, e)
            return answer
        return answer.with_body({**(answer.body if isinstance(answer.body, dict) else {}), "p2pw_slot": slot})

    async def _sglang(self, scope: dict, verb: str | None, body: Any, raw: bytes | None = None) -> steps.Answer:
        """sglang's own route of ``verb`` (None: the request's own) with ``body`` (``raw``: as it came)."""
        if verb is not None:
            path = routes.route(verb).path if verb in routes.BY_VERB else f"/{verb}"
            scope = {**scope, "path": scope.get("root_path", "") + path, "raw_path": path.encode()}
        data = raw if raw is not None else asgi.encode(body if body is not None else {})  # sglang's routes want one
        status, headers, out = await asgi.answer_of(self.app, scope, asgi.replay(data))
        text = out.decode("utf-8", "replace")
        return steps.Answer(status, asgi.decode(out), raw=out, headers=headers,
                            already_open=status == p.BAD_REQUEST and p.SESSION_ALREADY_OPEN in text)


def _adapter(body: Any) -> bool:
    """Whether the core's begin or end body is an adapter session's (the core put the adapter's name there)."""
    return isinstance(body, dict) and body.get(ADAPTER_KEY) is not None


def _adapter_ack(manifests: dict | None) -> steps.Answer:
    """An adapter session's begin or end: sglang runs nothing after its own adapter load either (the slot's
    bytes are what it serves), so none of its weight-update work runs (as our receiver, receiver/server.py)."""
    if manifests is not None:
        raise InvalidWrite("an adapter's update writes its slot directly: it takes no delta manifests")
    return steps.Answer(p.OK, bodies.encode(bodies.Ack()))


async def _apply(manifests: dict[int, dict]) -> None:
    """Every rank applies its manifest; raises when one refused (the core tears the engine)."""
    why = await delta_updates.apply({str(r): m for r, m in manifests.items()})
    if why:
        raise InvalidWrite(f"the deltas were not applied: {why}")
