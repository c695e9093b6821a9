"""The session gate of a vLLM 0.33 API server running the ``p2pweights`` backend: an ASGI middleware
vLLM loads with ``--middleware p2pweights.vllm_backend.gate.SessionGate`` (docs/vllm.md).

vLLM's RL routes (``vllm/entrypoints/rl/online/api_router.py``) and dev routes, mounted with
``VLLM_SERVER_DEV_MODE=1``, are not covered by ``--api-key`` (vLLM guards only ``/v1``, ``/v2``,
``/inference``, ``/cohere``). The gate:

- **the key**: every path of :data:`KEYED` needs ``Authorization: Bearer KEY`` (vLLM's ``--api-key``,
  else ``VLLM_API_KEY``, else ``P2PW_API_KEY``); without any key configured they are refused (401):
  open weight routes would let anyone on the network write the engine's weights.
- **the session** (``receiver/session_keeper.py``, the receiver's rules, kept once per engine here,
  in the API server process): :data:`GATED` paths go through ``admit``, vLLM's route and ``settle``
  under one lock. Another controller's call while an owner's session is live: 409; a lost owner's
  session (expired, released) leaves the engine torn until a complete update. A takeover first has
  every worker revoke its registrations (a new endpoint under the next epoch, ``rank_calls.revoke``).
  ``/start_weight_update`` needs a paused engine (stricter than vLLM: the writes land in live memory).
- **deltas' base** (``deltas/committed.py``): a begin's ``p2pw_delta`` claim is answered, the base
  forgotten at every begin, a reset and any ``/collective_rpc``; an end that succeeded answers
  ``p2pw_base``. An end carrying ``p2pw_delta`` manifests has every worker apply its own first
  (``/update_weights``, the backend's ``receive_weights``), then runs vLLM's finish; a refused apply
  tears the engine.
- **p2pweights' own routes**: ``GET /remote_instance_transfer_engine_info?rank=R`` (the rank's
  publication: the side channel vLLM's init route lacks), ``POST /p2pw_weights_digest``,
  ``POST /renew_weight_update``, ``POST /p2pw_apply_deltas``, ``GET /p2pw_weight_update``.
- **refused**: ``/sleep``, ``/wake_up`` and ``/scale_elastic_ep`` (they free or move the registered
  weight memory), and ``/collective_rpc`` calling the backend's own channel.

One API server process keeps one session: with ``--api-server-count > 1`` every gated path answers
503 (each process would keep its own).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

from ..control import bodies, routes
from ..control import protocol as p
from ..control.error_answers import error_payload
from ..control.http import key_matches
from ..deltas.area import Manifest
from ..deltas.committed import BASE_KEY, DELTA_KEY, CommittedBase
from ..errors import EngineError, InvalidRequest, InvalidWrite, P2PWeightsError, SessionConflict, TornWeights
from ..receiver import asgi_steps as asgi
from ..receiver import session_keeper as sk
from ..settings import value as setting
from . import rank_calls

logger = logging.getLogger(__name__)

BEGIN, END, RENEW, APPLY = "begin_weight_update", "end_weight_update", "renew_weight_update", "p2pw_apply_deltas"
WRITE = "update_weights_from_distributed"  # session_keeper's verb for a write inside the owner's session
UPDATE_WEIGHTS = "/update_weights"
PUBLICATION, DIGEST = routes.route("remote_instance_transfer_engine_info").path, routes.route("p2pw_weights_digest").path
STATE = "/p2pw_weight_update"
INIT = "/init_weight_transfer_engine"

#: vLLM's routes (and ours) under the owner rules -> session_keeper's verb
GATED: dict[str, str] = {
    "/pause": "pause_generation", "/resume": "continue_generation",
    "/start_weight_update": BEGIN, "/start_draft_weight_update": BEGIN, UPDATE_WEIGHTS: WRITE,
    "/finish_weight_update": END, routes.route("update_weight_version").path: "update_weight_version",
    INIT: "init_weights_update_group",
    "/shutdown_weight_transfer_engine": "destroy_weights_update_group",
    "/weight_checker": WRITE,   # only its "reset" action (it zeroes every weight); the others read
    "/collective_rpc": WRITE,   # any worker method: may write the weights
    routes.route(RENEW).path: RENEW, routes.route(APPLY).path: APPLY,
}
#: vLLM routes that free or move the weights' registered memory: refused outright
REFUSED = frozenset({"/sleep", "/wake_up", "/scale_elastic_ep"})
#: every path that needs the key: vLLM's RL and dev routes (which its --api-key leaves open) and ours
KEYED = frozenset(GATED) | REFUSED | {
    "/abort_requests", "/is_paused", "/weight_info", "/get_world_size", routes.route("server_info").path, "/reset_prefix_cache",
    "/reset_mm_cache", "/reset_encoder_cache", "/release_kv_cache_memory", "/is_sleeping", "/is_scaling_elastic_ep",
    PUBLICATION, DIGEST, STATE}
BODY_LIMIT = 32 << 20


class VllmSessions:
    """The engine's one session record, as ``session_keeper.admit`` needs its host: the owner rules
    (``session``), the committed base of deltas (``base``), and the revocation a takeover asks for."""

    def __init__(self, engine: str = "vllm", lease: float | None = None):
        self.session = sk.SessionKeeper(engine, lease)
        self.base = CommittedBase(engine)
        self.revoke_due = False

    def revoke_epoch(self) -> None:
        """Called by ``admit`` inside the gate's lock when a begin takes a lost session over; the gate
        then awaits every worker's revocation (``rank_calls.revoke``) before vLLM's start runs."""
        self.revoke_due = True

    def tear(self, owner: str, why: str) -> None:
        """The weights may be partly written and no one completes the update: torn until one does."""
        self.base.forget(why)
        self.session.release(owner)
        if self.session.open:
            self.session.torn = why


class SessionGate:
    """ASGI middleware (module docstring). vLLM adds it with ``app.add_middleware(SessionGate)``."""

    def __init__(self, app: Any, engine: str = "vllm", lease: float | None = None):
        self.app = app
        self.host = VllmSessions(engine, lease)
        self._lock = asyncio.Lock()
        self._keys: list[str] | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = asgi.route_path(scope) if scope["type"] == "http" else ""
        if path not in KEYED:
            return await self.app(scope, receive, send)
        try:
            self._check_key(scope)
            if path in REFUSED:
                raise InvalidRequest(f"{path} refused: it frees or moves the weights' memory, which the p2pweights "
                                     f"backend registered for one-sided writes")
            if path in GATED and _api_servers(scope) != 1:
                raise EngineError(f"{path} refused: p2pweights keeps one session per API server process; this "
                                  f"server runs {_api_servers(scope)} (--api-server-count)")
            if path == PUBLICATION:
                answer = await rank_calls.publication(_client(scope), _rank_param(scope))
                return await asgi.respond_json(send, p.OK, answer)
            if path == DIGEST:
                req = bodies.decode(bodies.WeightsDigestReq, _object(await asgi.read_body(receive, BODY_LIMIT)))
                return await asgi.respond_json(send, p.OK, await rank_calls.digests(_client(scope), req.names))
            if path == STATE:
                state = self.host.session.state()
                return await asgi.respond_json(send, p.OK, {**state, "state": str(state["state"])})
            if path not in GATED:
                return await self.app(scope, receive, send)
            status, headers, body = await self._gated(path, scope, receive)
        except (SessionConflict, TornWeights) as e:
            status, headers, body = p.CONFLICT, asgi.JSON_HEADERS, asgi.encode(error_payload(e))
        except _Unauthorized as e:
            status, headers, body = p.UNAUTHORIZED, asgi.JSON_HEADERS, asgi.encode(error_payload(str(e)))
        except (InvalidRequest, ValueError) as e:
            status, headers, body = p.BAD_REQUEST, asgi.JSON_HEADERS, asgi.encode(error_payload(e))
        except P2PWeightsError as e:
            status, headers, body = p.ENGINE_FAILED, asgi.JSON_HEADERS, asgi.encode(error_payload(e))
        await asgi.respond(send, status, headers, body)

    # ---- the key --------------------------------------------------------------------------------
    def _check_key(self, scope: dict) -> None:
        if self._keys is None:
            args = getattr(getattr(scope.get("app"), "state", None), "args", None)
            keys = list(getattr(args, "api_key", None) or []) or [os.environ.get("VLLM_API_KEY") or ""]
            self._keys = [k for k in keys if k] or [k for k in [setting("P2PW_API_KEY")] if k]
        if not self._keys:
            raise _Unauthorized("Unauthorized: this vLLM server has no API key, and p2pweights serves its weight "
                                "routes only with one (--api-key, VLLM_API_KEY or P2PW_API_KEY)")
        given = asgi.header(scope, "authorization")
        if not any(key_matches(given, key) for key in self._keys):
            raise _Unauthorized("Unauthorized: this engine's weight routes require its API key "
                                "(Authorization: Bearer KEY)")

    # ---- one gated call -------------------------------------------------------------------------
    async def _gated(self, path: str, scope: dict, receive: Any) -> tuple[int, list, bytes]:
        verb, client, host, session = GATED[path], _client(scope), self.host, self.host.session
        headers = asgi.Headers(scope)
        owner, lease = sk.owner_of(headers), sk.lease_of(headers)
        raw = await asgi.read_body(receive, BODY_LIMIT)
        obj = asgi.decode(raw)
        if path == "/weight_checker" and not (isinstance(obj, dict) and obj.get("action") == "reset"):
            return await asgi.answer_of(self.app, scope, asgi.replay(raw))  # a checksum or compare: a read
        if path == "/collective_rpc" and isinstance(obj, dict) and obj.get("method") == rank_calls.RPC_METHOD:
            raise InvalidRequest(f"/collective_rpc refused: {rank_calls.RPC_METHOD} is the p2pweights gate's own "
                                 f"channel into the workers")
        async with self._lock if verb != RENEW else contextlib.nullcontext():
            taking_over = verb == BEGIN and session.lost
            host.revoke_due = False
            sk.admit(host, verb, owner)
            if verb == RENEW:
                req = bodies.decode(bodies.RenewWeightUpdateReq, _object(raw))
                return p.OK, asgi.JSON_HEADERS, asgi.encode(sk.renew_lease(session, req.release, headers))
            if verb == APPLY:
                return await self._apply_now(client, obj, owner)
            if host.revoke_due:  # a takeover: the lost owner's connections and keys must fail first
                await self._revoke(client)
            delta = None
            if verb == BEGIN:
                if not await client.is_paused():
                    raise InvalidRequest("generation is running; call /pause before /start_weight_update "
                                         "(p2pweights writes land in live parameter memory)")
                claim = obj.pop(DELTA_KEY, None) if isinstance(obj, dict) else None
                support = await rank_calls.delta_support(client) if claim is not None else ""
                delta = host.base.open(claim, session.epoch, support)  # from here the weights may change
                raw = b""  # vLLM's start takes no body
            elif verb == END and isinstance(obj, dict) and obj.get(DELTA_KEY) is not None:
                refused = await self._apply(client, obj.pop(DELTA_KEY), owner, path)
                if refused is not None:
                    return refused
                raw = asgi.encode(obj)
            elif path == UPDATE_WEIGHTS and _names_deltas(obj):
                self._take_acceptance(path)
            elif path == INIT:
                await rank_calls.attach_drafts(client)  # the drafters register with the targets
            status, out_headers, body = await self._vllm_answer(scope, raw)
            if taking_over and not p.ok(status) and b"already active" in body:
                # vLLM's session is still the lost owner's: the new owner continues it (not begun again)
                status, out_headers = p.OK, asgi.JSON_HEADERS
                body = asgi.encode({"message": f"took over a {p.TORN} weight-update session: a complete update "
                                               f"heals it"})
            answer = sk.settle(session, verb, headers, owner, lease, status, asgi.decode(body) if verb == BEGIN else None)
            return self._settled(path, verb, owner, status, out_headers, body, answer, delta)

    async def _vllm_answer(self, scope: dict, raw: bytes) -> tuple[int, list, bytes]:
        """vLLM's route's answer. A route that raises (a worker's RuntimeError) is answered by vLLM's
        handler of ``Exception`` in Starlette's outermost middleware, outside this gate: caught here,
        so that a failed call is settled (torn, base forgotten) like one that answered an error."""
        try:
            return await asgi.answer_of(self.app, scope, asgi.replay(raw))
        except Exception as e:  # noqa: BLE001 - any failure of vLLM's route is an answer to settle
            logger.warning("p2pweights gate: %s failed in vLLM: %s: %s", asgi.route_path(scope), type(e).__name__, e)
            return p.ENGINE_FAILED, asgi.JSON_HEADERS, asgi.encode(error_payload(f"{type(e).__name__}: {e}"))

    def _settled(self, path: str, verb: str, owner: str, status: int, headers: list, body: bytes, answer: Any,
                 delta: dict | None) -> tuple[int, list, bytes]:
        """What a gated call leaves behind once vLLM answered ``status``."""
        host = self.host
        if verb == BEGIN and p.ok(status):
            return status, asgi.JSON_HEADERS, asgi.encode({**answer, DELTA_KEY: delta})
        if verb == END and p.ok(status):  # the weights now: a new identity for the next delta
            base = host.base.commit(host.session.epoch)
            return status, asgi.JSON_HEADERS, asgi.encode({**(asgi.decode(body) or {}), BASE_KEY: base})
        if verb == END:
            host.base.forget("the last /finish_weight_update failed")
        elif path == UPDATE_WEIGHTS and not p.ok(status):
            # vLLM's worker closes its session when update_weights raises: the weights may be partly written
            host.tear(owner, f"/update_weights failed (HTTP {status}): the weights may be partly written")
        elif path in ("/weight_checker", "/collective_rpc") and p.ok(status):
            host.base.forget(f"{path} ran on the workers after the last commit")
        return status, headers, body

    async def _revoke(self, client: Any) -> None:
        epoch = self.host.session.epoch + 1
        await rank_calls.revoke(client, epoch)  # a failure raises: the begin fails, the engine stays torn
        self.host.session.epoch = epoch
        logger.warning("p2pweights: a takeover revoked epoch %d's registrations on every worker", epoch - 1)

    def _take_acceptance(self, where: str) -> None:
        if not self.host.base.accepted:
            raise InvalidRequest(f"{where} names deltas, but this session's begin did not accept any (or they were "
                                 f"applied already)")
        self.host.base.accepted = False  # applied once: a second apply of the same records would be refused

    async def _apply(self, client: Any, manifests: Any, owner: str, where: str) -> tuple[int, list, bytes] | None:
        """Every worker applies its own manifest (None when all did); a refusal tears the engine."""
        parsed = _manifests(manifests, where)
        self._take_acceptance(where)
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        try:
            await client.update_weights(request=WeightTransferUpdateRequest(update_info={DELTA_KEY: parsed}))
        except Exception as e:  # noqa: BLE001 - any worker's refusal: nothing is known to be whole
            why = f"the deltas were refused, the weights may be partly applied: {type(e).__name__}: {e}"
            self.host.tear(owner, why)
            error = InvalidWrite(f"{where} refused: the deltas were not applied: {e}")
            return p.ENGINE_FAILED, asgi.JSON_HEADERS, asgi.encode(error_payload(error))
        return None

    async def _apply_now(self, client: Any, obj: Any, owner: str) -> tuple[int, list, bytes]:
        """``POST /p2pw_apply_deltas {"manifests"}``: the deltas now, inside the session (verify=True)."""
        if not self.host.session.open:
            raise InvalidRequest(f"{p.NO_SESSION} is open; deltas are applied inside a session")
        refused = await self._apply(client, _object_of(obj).get("manifests"), owner, APPLY)
        return refused or (p.OK, asgi.JSON_HEADERS, asgi.encode(bodies.encode(bodies.Ack())))


class _Unauthorized(Exception):
    pass


def _manifests(manifests: Any, where: str) -> dict[str, dict]:
    if not isinstance(manifests, dict):
        raise InvalidRequest(f"{where}: {DELTA_KEY} must be {{rank: manifest}}")
    out = {}
    for rank, m in manifests.items():
        if not (isinstance(rank, str) and rank.isdigit()):
            raise InvalidRequest(f"{where}: {DELTA_KEY} has a key {rank!r} that is not a rank")
        try:
            out[rank] = Manifest.parse(m, f"{where} {DELTA_KEY}[{rank}]").to_dict()
        except InvalidWrite as e:
            raise InvalidRequest(str(e)) from None
    return out


def _names_deltas(obj: Any) -> bool:
    info = obj.get("update_info") if isinstance(obj, dict) else None
    infos = info if isinstance(info, list) else [info]
    return any(isinstance(i, dict) and DELTA_KEY in i for i in infos)


def _object(raw: bytes) -> dict:
    return _object_of(asgi.decode(raw) if raw.strip() else {})


def _object_of(obj: Any) -> dict:
    if not isinstance(obj, dict):
        raise InvalidRequest("the body must be a JSON object")
    return obj


def _client(scope: dict) -> Any:
    return scope["app"].state.engine_client


def _api_servers(scope: dict) -> int:
    args = getattr(scope["app"].state, "args", None)
    return int(getattr(args, "api_server_count", None) or 1)


def _rank_param(scope: dict) -> int:
    from urllib.parse import parse_qs

    values = parse_qs((scope.get("query_string") or b"").decode("latin-1")).get("rank", ["0"])
    if not values[0].isdigit():
        raise InvalidRequest(f"rank must be an integer >= 0, got {values[0][:20]!r}")
    return int(values[0])
