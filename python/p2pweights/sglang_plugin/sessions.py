"""Weight-update sessions with owner tokens, engine-bounded leases and the torn state, kept inside a
real sglang server's HTTP process by the receiver's own rules (``receiver/session_keeper.py``: one
implementation, two hosts). docs/sglang.md, "Sessions".

Where: a BEFORE hook on sglang's ``sglang.srt.entrypoints.http_server._setup_and_run_http_server``,
which the launcher calls once the engine's subprocesses run, just before uvicorn (or Granian's
embedded server) serves sglang's FastAPI ``app``. The hook (:func:`before_http_server`) adds to that
``app``:

- ``POST /renew_weight_update``, p2pweights' own route (the receiver's body and answers), marked
  ``ADMIN_OPTIONAL`` like sglang's control routes, so sglang's key middleware guards it alike;
- :class:`SessionGate`, an ASGI middleware in front of sglang's routes. A call of a route in
  :data:`GATED_PATHS` goes through ``session_keeper.admit`` (another controller's call of a live
  session: 409 ``SessionConflict``; a torn engine's: 409 ``TornWeights``; nothing reaches sglang),
  then sglang's own route, then ``session_keeper.settle`` (a begin that succeeded opens the caller's
  session and answers its lease; an end that succeeded closes it), as one step under one lock.

sglang already serves ``/begin_weight_update`` and ``/end_weight_update`` (0.5.23's own session:
it restores packed quantized weights at begin and post-processes at end), so the plugin adds no
begin or end of its own: the p2pweights session is sglang's session plus an owner and a lease. A
lost owner's session (expired, given up) stays open in sglang; the next owner's begin takes it over
(sglang's "already open" is answered as the receiver's takeover) and its end heals it.

Deltas (docs/sglang.md, "Deltas"; ``delta_updates.py``): the gate also keeps the engine's committed
identity. A begin answers the claim ``p2pw_delta`` (removed from the body sglang reads); an end that
names manifests has every rank apply its own before sglang's end runs, and answers ``p2pw_base``; a
refused apply fails the end and tears the weights. ``POST /p2pw_apply_deltas`` (``verify=True``) is
answered by the gate itself.

Fencing (docs/sglang.md, "Fencing"; ``fencing.py``): a begin that takes a lost owner's session over
first has every rank move its registrations to a new endpoint under the next epoch (the old one
closed), and answers that epoch; a revocation that fails answers 500 and leaves the engine torn.

sglang adds its API-key middleware after this hook ran, so the key middleware wraps the gate: a call
without the key is refused (401) before the gate reads it.

Not covered: a server with several HTTP workers (``--tokenizer-worker-num > 1``: each would keep its
own session; the plugin offers no sessions there, and says why), the native gRPC server, and the
engine's other processes (a scheduler obeys whatever reaches it).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse

from ..control import bodies, routes
from ..control import protocol as p
from ..control.error_answers import error_payload
from ..deltas.committed import BASE_KEY, DELTA_KEY
from ..errors import EngineError, InvalidRequest, InvalidWrite, SessionConflict, TornWeights
from ..receiver import asgi_steps as asgi
from ..receiver import session_keeper as sk
from . import delta_updates, fencing

logger = logging.getLogger(__name__)

TARGET = "sglang.srt.entrypoints.http_server._setup_and_run_http_server"
OFFER = "sessions"  # what p2pw_plugin.offers lists while the gate is installed

BEGIN, END, RENEW = "begin_weight_update", "end_weight_update", "renew_weight_update"
APPLY = "p2pw_apply_deltas"  # verify=True with deltas: the owner has the ranks apply before its digests
RENEW_PATH, APPLY_PATH = routes.route(RENEW).path, routes.route(APPLY).path

#: sglang's routes under the owner rules -> the verb ``session_keeper`` knows each by: the receiver's
#: gated verbs that sglang serves, the renewal this plugin adds, and sglang's other routes that write
#: the weights or free and restore their memory (where the owner's one-sided writes land)
GATED_PATHS: dict[str, str] = {
    **{r.path: r.verb for r in routes.ROUTES if r.verb in sk.GATED and not r.p2pw},
    RENEW_PATH: RENEW,
    APPLY_PATH: APPLY,  # answered by the gate itself (no route of sglang's)
    **{f"/{verb}": verb for verb in ("update_weights_from_tensor", "update_weights_from_disk",
                                     "update_weights_from_ipc", "release_memory_occupation",
                                     "resume_memory_occupation")},
}

_JSON = asgi.JSON_HEADERS


class SglangSessionHost:
    """The host ``session_keeper.admit`` needs: the HTTP process's one :class:`SessionKeeper`
    (``lease``: the longest it grants, default ``P2PW_SESSION_LEASE`` in the server's environment)."""

    def __init__(self, engine: str, lease: float | None = None):
        self.session = sk.SessionKeeper(engine, lease)
        self.revoking = False  # admit asked for a revocation; the gate awaits it before sglang's begin

    def revoke_epoch(self) -> None:
        """``session_keeper.admit``'s call at a takeover of a lost owner's session. The ranks are reached
        through sglang's async communicator, so this only marks it: the gate awaits :meth:`revoke` next,
        still under its lock, before the begin reaches sglang."""
        self.revoking = True

    async def revoke(self) -> None:
        """Every rank moves its registrations to a new endpoint under the next epoch (``fencing.py``);
        raises EngineError (the begin fails, the engine stays torn) when one cannot."""
        self.revoking = False
        self.session.epoch = await fencing.revoke(self.session.epoch, self.session.engine)


# The HTTP process's host once installed; why sessions are not offered when they could not be.
HOST: SglangSessionHost | None = None
REFUSED: str | None = None


def before_http_server(*args: Any, **kwargs: Any) -> None:
    """The BEFORE hook: install the gate and the renewal on sglang's ``app`` before it serves. Never
    raises (a failure is logged at ERROR and reported in ``p2pw_plugin.error``); leaves sglang's
    arguments as they are."""
    from sglang.srt.entrypoints import http_server
    from sglang.srt.runtime_context import get_serving

    serving = get_serving()
    try:
        install(http_server.app, workers=int(serving.tokenizer_worker_num),
                engine=f"http://{serving.host}:{serving.port}")
    except Exception as e:  # noqa: BLE001 - sglang must start either way; the refusal is loud
        refuse(f"sessions not installed: {type(e).__name__}: {e}")
    return None


def install(app: Any, *, workers: int = 1, engine: str = "engine", lease: float | None = None) -> SglangSessionHost | None:
    """Add the renewal route and :class:`SessionGate` to sglang's FastAPI ``app`` (before it serves).
    Refuses (None, logged, :data:`REFUSED`) where one session cannot be kept: several HTTP workers,
    or an app that lacks a gated route (sglang's routes changed)."""
    global HOST
    if workers != 1:
        return refuse(f"sessions need one HTTP process; this server runs {workers} (--tokenizer-worker-num), each "
                      f"would keep its own session")
    served = {getattr(r, "path", None) for r in app.router.routes}
    missing = sorted(set(GATED_PATHS) - {RENEW_PATH, APPLY_PATH} - served)
    if missing:
        return refuse(f"sessions not installed: this sglang serves no {', '.join(missing)}")
    if RENEW_PATH in served:
        return refuse(f"sessions not installed: {RENEW_PATH} is served already (by another plugin?)")
    host = SglangSessionHost(engine, lease)
    app.add_api_route(RENEW_PATH, renew_endpoint(host), methods=["POST"])
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
    state = HOST.session.state()
    return {"offers": [OFFER], "error": None, "weight_update": {**state, "state": str(state["state"])}}


def renew_endpoint(host: SglangSessionHost) -> Any:
    """``POST /renew_weight_update {"release": bool}``: the receiver's route (its owner was admitted by
    the gate): 200 ``{"success", "message", "lease"}``; 400 no session, a bad lease header or body."""
    from sglang.srt.utils.auth import AuthLevel, auth_level

    @auth_level(AuthLevel.ADMIN_OPTIONAL)
    async def renew_weight_update(request: Request) -> JSONResponse:
        try:
            raw = await request.body()
            try:
                obj = json.loads(raw) if raw.strip() else {}
            except ValueError:
                raise InvalidRequest("the body must be a JSON object") from None
            if not isinstance(obj, dict):
                raise InvalidRequest("the body must be a JSON object")
            req = bodies.decode(bodies.RenewWeightUpdateReq, obj)
            return JSONResponse(sk.renew_lease(host.session, req.release, request.headers))
        except InvalidRequest as e:
            return JSONResponse(error_payload(e), status_code=p.BAD_REQUEST)

    return renew_weight_update


class SessionGate:
    """ASGI middleware: the owner rules around each call of a gated sglang route (module docstring).
    Gated calls run one at a time (the receiver's control lock), except the renewal and the
    broadcast group's join and leave (``session_keeper.UNLOCKED``), as on a receiver."""

    def __init__(self, app: Any, host: SglangSessionHost):
        self.app, self.host = app, host
        self._lock = asyncio.Lock()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        verb = GATED_PATHS.get(asgi.route_path(scope)) if scope["type"] == "http" else None
        if verb is None:
            return await self.app(scope, receive, send)
        try:
            status, headers, body = await self._gated(verb, scope, receive)
        except (SessionConflict, TornWeights) as e:
            status, headers, body = p.CONFLICT, _JSON, asgi.encode(error_payload(e))
        except InvalidRequest as e:
            status, headers, body = p.BAD_REQUEST, _JSON, asgi.encode(error_payload(e))
        except EngineError as e:  # a takeover that could not revoke: still torn
            status, headers, body = p.ENGINE_FAILED, _JSON, asgi.encode(error_payload(e))
        await asgi.respond(send, status, headers, body)

    async def _gated(self, verb: str, scope: dict, receive: Any) -> tuple[int, list, bytes]:
        headers = Headers(scope=scope)
        owner, lease = sk.owner_of(headers), sk.lease_of(headers)
        session = self.host.session
        async with self._lock if verb not in sk.UNLOCKED else contextlib.nullcontext():
            taking_over = verb == BEGIN and session.lost
            sk.admit(self.host, verb, owner)
            if self.host.revoking:  # a takeover: the lost owner's registrations go before sglang's begin
                await self.host.revoke()
            if verb == APPLY:
                return await _apply_now(receive, session, owner)
            claim, receive = (await _delta_part(receive)) if verb in (BEGIN, END) else (None, receive)
            if verb == BEGIN:  # from here the weights may change: the committed base is forgotten
                delta = delta_updates.BASE.open(claim, session.epoch, delta_updates.support())
            elif verb == END and claim is not None:  # the deltas first, then sglang's post-processing
                refused = await _apply_deltas(claim, session, owner)
                if refused is not None:
                    return refused
            status, out_headers, body = await asgi.answer_of(self.app, scope, receive)
            if taking_over and status == p.BAD_REQUEST and p.SESSION_ALREADY_OPEN in body.decode("utf-8", "replace"):
                # sglang's session is still the lost owner's: the new owner continues it (not begun again)
                status, out_headers = p.OK, _JSON
                body = asgi.encode(bodies.encode(bodies.Ack(
                    message=f"took over a {p.TORN} weight-update session: a complete update heals it")))
            answer = sk.settle(session, verb, headers, owner, lease, status, asgi.decode(body) if verb == BEGIN else None)
            if verb == BEGIN and p.ok(status):
                out_headers, body = _JSON, asgi.encode({**answer, DELTA_KEY: delta})
            elif verb == END and p.ok(status):  # the weights now: a new identity for the next delta
                base = delta_updates.BASE.commit(session.epoch)
                out_headers, body = _JSON, asgi.encode({**(asgi.decode(body) or {}), BASE_KEY: base})
            elif verb == END:
                delta_updates.BASE.forget("the last end_weight_update failed")
        return status, out_headers, body


async def _delta_part(receive: Any) -> tuple[Any, Any]:
    """The body's ``p2pw_delta`` (None without one) and the body without it, as sglang reads it."""
    raw = await asgi.read_body(receive)
    obj = asgi.decode(raw) if raw.strip() else None
    if not isinstance(obj, dict) or DELTA_KEY not in obj:
        return None, asgi.replay(raw)
    claim = obj.pop(DELTA_KEY)
    return claim, asgi.replay(asgi.encode(obj))


async def _apply_now(receive: Any, session: sk.SessionKeeper, owner: str) -> tuple[int, list, bytes]:
    """``POST /p2pw_apply_deltas {"manifests"}``: the deltas now, inside the session (the receiver's route)."""
    obj = asgi.decode(await asgi.read_body(receive))
    if not isinstance(obj, dict):
        raise InvalidRequest("the body must be a JSON object")
    if not session.open:
        raise InvalidRequest(f"{p.NO_SESSION} is open; deltas are applied inside a session")
    refused = await _apply_deltas(obj.get("manifests"), session, owner)
    return refused or (p.OK, _JSON, asgi.encode(bodies.encode(bodies.Ack())))


async def _apply_deltas(manifests: Any, session: sk.SessionKeeper, owner: str) -> tuple[int, list, bytes] | None:
    """Every rank applies its manifest (None when all did); a refusal fails the end and tears the weights."""
    if not delta_updates.BASE.accepted:
        raise InvalidRequest("end_weight_update names deltas, but this session's begin did not accept any")
    parsed = delta_updates.parse_manifests(manifests, "end_weight_update")
    delta_updates.BASE.accepted = False  # applied once: a second apply of the same records would be refused
    why = await delta_updates.apply(parsed)
    if not why:
        return None
    delta_updates.BASE.forget("a delta apply was refused")
    session.release(owner)  # torn until a complete update heals it (the next begin takes it over)
    session.torn = f"the deltas were refused, the weights may be partly applied: {why}"
    error = InvalidWrite(f"end_weight_update refused: the deltas were not applied: {why}")
    return p.ENGINE_FAILED, _JSON, asgi.encode(error_payload(error))
