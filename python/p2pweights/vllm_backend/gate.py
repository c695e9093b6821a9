"""The session gate of a vLLM 0.33 API server running the ``p2pweights`` backend: an ASGI middleware
vLLM loads with ``--middleware p2pweights.vllm_backend.gate.SessionGate`` (docs/vllm.md).

vLLM's RL routes (``vllm/entrypoints/rl/online/api_router.py``) and dev routes, mounted with
``VLLM_SERVER_DEV_MODE=1``, are not covered by ``--api-key`` (vLLM guards only ``/v1``, ``/v2``,
``/inference``, ``/cohere``). The gate:

- **the key**: every path of :data:`KEYED` needs ``Authorization: Bearer KEY`` (vLLM's ``--api-key``,
  else ``VLLM_API_KEY``, else ``P2PW_API_KEY``); without any key configured they are refused (401):
  open weight routes would let anyone on the network write the engine's weights.
- **the session**: this gate hosts the engine core (``engine/core.py``: owner rules, lease,
  epochs, the tear rule, the delta base, kept once per engine here, in the API server process) and
  only maps: :data:`GATED` paths onto the core's verbs, and the core's steps onto vLLM (its pause
  state, its routes, the workers' revocation, delta support and apply through ``rank_calls``;
  ``/update_weights`` naming ``p2pw_delta`` manifests is the core's apply of deltas).
- **p2pweights' own routes**: ``GET /remote_instance_transfer_engine_info?rank=R`` (the rank's
  publication: the side channel vLLM's init route lacks), ``POST /p2pw_weights_digest``,
  ``POST /renew_weight_update``, ``POST /p2pw_apply_deltas``, ``GET /p2pw_weight_update``.
- **LoRA adapters** (docs/lora.md): vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
  are the core's ``load_lora_adapter`` / ``unload_lora_adapter`` (owner rules, refused while a
  session is open, the adapter's base forgotten). A load with ``"pinned": true`` (p2pweights'
  field, taken out before vLLM's route sees the body) is followed by vLLM's own ``pin_lora``, and
  answered as JSON with the slot (``p2pw_slot``); an unload also removes it from the workers
  (vLLM's ``remove_lora``: vLLM's unload forgets the name only, and would leave a pinned adapter in
  its slot for good). A begin
  ``{"adapter": name}`` asks every worker for the slot vLLM gave it (``rank_lora.py``); an adapter
  session runs neither vLLM's start nor its finish (no base weight changes, nothing post-processed).
- **refused**: ``/sleep``, ``/wake_up`` and ``/scale_elastic_ep`` (they free or move the registered
  weight memory), and ``/collective_rpc`` calling the backend's own channel.

One API server process keeps one session: with ``--api-server-count > 1`` every gated path answers
503 (each process would keep its own).
"""
from __future__ import annotations

import logging
import os
from typing import Any

from ..control import bodies, routes
from ..control import protocol as p
from ..control.error_answers import error_payload
from ..control.http import key_matches
from ..deltas.committed import DELTA_KEY
from ..engine import core as ec
from ..engine import steps
from ..engine.adapters import ADAPTER_KEY, LOAD_ADAPTER, UNLOAD_ADAPTER
from ..errors import EngineError, InvalidRequest, InvalidWrite
from ..front import answer_for, asgi
from ..front.verb_answers import respond_verb
from ..settings import value as setting
from . import rank_calls

logger = logging.getLogger(__name__)

UPDATE_WEIGHTS = "/update_weights"
PUBLICATION, DIGEST = routes.route("remote_instance_transfer_engine_info").path, routes.route("p2pw_weights_digest").path
STATE = "/p2pw_weight_update"
INIT = "/init_weight_transfer_engine"
CHECKER, RPC = "/weight_checker", "/collective_rpc"
LOAD_LORA, UNLOAD_LORA = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"  # vLLM's own LoRA API

#: vLLM's routes (and ours) -> the engine core's verb
GATED: dict[str, str] = {
    "/pause": ec.PAUSE, "/resume": ec.CONTINUE, "/start_weight_update": ec.BEGIN, "/start_draft_weight_update": ec.BEGIN,
    UPDATE_WEIGHTS: "update_weights_from_distributed", "/finish_weight_update": ec.END,
    routes.route("update_weight_version").path: ec.VERSION, INIT: ec.JOIN, "/shutdown_weight_transfer_engine": ec.LEAVE,
    CHECKER: "reset_weights",   # only its "reset" action (it zeroes every weight); the others read
    RPC: "collective_rpc",      # any worker method: may rewrite the weights
    routes.route(ec.RENEW).path: ec.RENEW, routes.route(ec.APPLY).path: ec.APPLY,
    LOAD_LORA: LOAD_ADAPTER, UNLOAD_LORA: UNLOAD_ADAPTER,  # the engine's own writes of an adapter's slot
}
#: vLLM routes that free or move the weights' registered memory: refused outright
REFUSED = frozenset({"/sleep", "/wake_up", "/scale_elastic_ep"})
#: every path that needs the key: vLLM's RL and dev routes (which its --api-key leaves open) and ours
KEYED = frozenset(GATED) | REFUSED | {
    "/abort_requests", "/is_paused", "/weight_info", "/get_world_size", routes.route("server_info").path, "/reset_prefix_cache",
    "/reset_mm_cache", "/reset_encoder_cache", "/release_kv_cache_memory", "/is_sleeping", "/is_scaling_elastic_ep",
    PUBLICATION, DIGEST, STATE}
BODY_LIMIT = 32 << 20


class SessionGate:
    """ASGI middleware (module docstring). vLLM adds it with ``app.add_middleware(SessionGate)``."""

    def __init__(self, app: Any, engine: str = "vllm", lease: float | None = None):
        self.app = app
        self.core = ec.EngineCore(engine, lease)
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
            try:
                raw = await asgi.read_body(receive, BODY_LIMIT)
            except ValueError as e:
                return await asgi.respond_json(send, p.PAYLOAD_TOO_LARGE, answer_for(InvalidRequest(str(e)))[1])
            if path == PUBLICATION:
                answer = await rank_calls.publication(_client(scope), _rank_param(scope))
                return await asgi.respond_json(send, p.OK, answer)
            if path == DIGEST:
                req = bodies.decode(bodies.WeightsDigestReq, _object(raw))
                return await asgi.respond_json(send, p.OK, await rank_calls.digests(_client(scope), req.names))
            if path == STATE:
                return await asgi.respond_json(send, p.OK, self.core.state())
            if path not in GATED:
                return await self.app(scope, asgi.replay(raw), send)
        except _Unauthorized as e:
            return await asgi.respond_json(send, p.UNAUTHORIZED, error_payload(str(e)))
        except Exception as e:  # noqa: BLE001 - every failure is an answer (front/error_status.py)
            status, payload = answer_for(e, path)
            return await asgi.respond_json(send, status, payload)

        async def run() -> Any:
            verb, body = _verb(path, asgi.decode(raw))
            if verb is None:  # a read of the weight checker: anyone's
                return await self.app(scope, asgi.replay(raw), send)
            return await self.core.run_async(verb, asgi.Headers(scope), body, lambda step: self._step(step, scope, raw))

        await respond_verb(send, path, run)

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

    # ---- the core's steps, the vLLM way ---------------------------------------------------------
    async def _step(self, step: steps.Step, scope: dict, raw: bytes) -> Any:
        client = _client(scope)
        if isinstance(step, steps.AdapterSlot):
            return await self._adapter_slot(scope, step.name)
        if _adapter_session(step):  # an adapter's begin or end: nothing of vLLM's runs
            return steps.Answer(p.OK, {"success": True, "message": f"LoRA adapter {step.body[ADAPTER_KEY]!r}: its slot "
                                                                   f"is written directly"})
        if isinstance(step, steps.EngineVerb) and step.verb in (LOAD_ADAPTER, UNLOAD_ADAPTER):
            return await self._lora_route(scope, step.verb, step.body if isinstance(step.body, dict) else {})
        if isinstance(step, steps.IsPaused):
            return bool(await client.is_paused())
        if isinstance(step, steps.DeltaSupport):
            return await rank_calls.delta_support(client)
        if isinstance(step, steps.PublishedEpochs):
            return []
        if isinstance(step, steps.Revoke):
            await rank_calls.revoke(client, step.epoch)  # a failure raises: the begin fails, the engine stays torn
            return step.epoch
        if isinstance(step, steps.ApplyDeltas):
            return await _apply(client, step.manifests)
        if isinstance(step, steps.End):
            if step.manifests is not None:  # the deltas first, then vLLM's finish (its post-processing)
                await _apply(client, step.manifests)
            return await self._vllm(scope, step.body)
        if step.verb == ec.RENEW:
            return steps.Answer(p.OK, {})
        if step.verb == ec.BEGIN:
            return await self._vllm(scope, None)  # vLLM's start takes no body
        if step.verb == ec.JOIN:
            await rank_calls.attach_drafts(client)  # the drafters register with the targets
        return await self._vllm(scope, None, raw)

    # ---- LoRA adapters, the vLLM way --------------------------------------------------------------
    async def _adapter_slot(self, scope: dict, name: str) -> int:
        """The slot vLLM gave adapter ``name`` on every worker (the same on all, pinned), or raises."""
        lora_id = _lora_id(scope, name)
        answers = await rank_calls.call_ranks(_client(scope), "adapter_slot", {"lora_int_id": lora_id,
                                                                              "lora_name": name})
        slots = {int(a["rank"]): int(a["slot"]) for a in answers}
        if len(set(slots.values())) != 1:
            raise EngineError(f"the vLLM workers put LoRA adapter {name!r} in different slots ({slots})", parameter=name)
        unpinned = sorted(int(a["rank"]) for a in answers if not a.get("pinned"))
        if unpinned:
            raise InvalidRequest(f"vLLM has not pinned it (rank(s) {unpinned}): vLLM may evict it and later copy its "
                                 f"own copy of the adapter back over an update", parameter=name)
        return next(iter(slots.values()))

    async def _lora_route(self, scope: dict, verb: str, body: dict) -> steps.Answer:
        """vLLM's own load or unload route, then vLLM's ``pin_lora`` (a load asking for it) or ``remove_lora``."""
        body = dict(body)
        pinned = bool(body.pop("pinned", False))
        name, client = str(body.get("lora_name")), _client(scope)
        before = _lora_id(scope, name) if verb == UNLOAD_ADAPTER and name in _lora_requests(scope) else None
        answer = await self._vllm(scope, body)
        if not answer.ok:
            return answer
        message = answer.raw.decode("utf-8", "replace") if answer.body is None and answer.raw else answer.body
        out: dict[str, Any] = {"success": True, "message": message}
        if verb == LOAD_ADAPTER:
            lora_id = _lora_id(scope, name)
            if pinned and not await client.pin_lora(lora_id):
                raise EngineError(f"vLLM did not pin LoRA adapter {name!r} (id {lora_id})", parameter=name)
            out.update(lora_int_id=lora_id, pinned=pinned)
            if pinned:
                out["p2pw_slot"] = await self._adapter_slot(scope, name)
        elif before is not None:  # vLLM's unload forgets the name only: the workers would keep it in its slot
            await client.remove_lora(before)
        return steps.Answer(p.OK, out)

    async def _vllm(self, scope: dict, body: Any, raw: bytes | None = None) -> steps.Answer:
        """vLLM's own answer to the request's route with ``body`` (``raw``: as it came)."""
        data = raw if raw is not None else (asgi.encode(body) if body else b"")
        try:
            status, headers, out = await asgi.answer_of(self.app, scope, asgi.replay(data))
        except Exception as e:  # noqa: BLE001 - a worker's error raises through vLLM's route: an answer here
            out, headers = asgi.encode(error_payload(f"{asgi.route_path(scope)} failed in vLLM: {type(e).__name__}: "
                                                     f"{e}")), asgi.JSON_HEADERS
            status = p.ENGINE_FAILED
        return steps.Answer(status, asgi.decode(out), raw=out, headers=headers,
                            already_open=not p.ok(status) and b"already active" in out)


class _Unauthorized(Exception):
    pass


def _verb(path: str, obj: Any) -> tuple[str | None, Any]:
    """The core's verb of a gated call and the body it takes (None: a read, anyone's)."""
    if path == CHECKER and not (isinstance(obj, dict) and obj.get("action") == "reset"):
        return None, obj  # a checksum or compare: a read
    if path == RPC and isinstance(obj, dict) and obj.get("method") == rank_calls.RPC_METHOD:
        raise InvalidRequest(f"{RPC} refused: {rank_calls.RPC_METHOD} is the p2pweights gate's own channel into the "
                             f"workers")
    if path == UPDATE_WEIGHTS and _names_deltas(obj):
        infos = obj["update_info"] if isinstance(obj["update_info"], list) else [obj["update_info"]]
        manifests = next(i[DELTA_KEY] for i in infos if isinstance(i, dict) and DELTA_KEY in i)
        return ec.APPLY, {"manifests": manifests}
    return GATED[path], obj if isinstance(obj, dict) else None


async def _apply(client: Any, manifests: dict[int, dict]) -> None:
    """Every worker applies its own manifest (the backend's ``receive_weights``); raises when one refused."""
    try:
        await client.update_weights(request=_update_request({DELTA_KEY: {str(r): m for r, m in manifests.items()}}))
    except Exception as e:  # noqa: BLE001 - a worker refused its manifest (vLLM reports it as its own error)
        raise InvalidWrite(f"the deltas were not applied: {type(e).__name__}: {e}") from e


def _update_request(update_info: dict) -> Any:
    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    return WeightTransferUpdateRequest(update_info=update_info)


def _names_deltas(obj: Any) -> bool:
    info = obj.get("update_info") if isinstance(obj, dict) else None
    infos = info if isinstance(info, list) else [info]
    return any(isinstance(i, dict) and DELTA_KEY in i for i in infos)


def _object(raw: bytes) -> dict:
    obj = asgi.decode(raw) if raw.strip() else {}
    if not isinstance(obj, dict):
        raise InvalidRequest("the body must be a JSON object")
    return obj


def _client(scope: dict) -> Any:
    return scope["app"].state.engine_client


def _adapter_session(step: Any) -> bool:
    """The begin or end of an adapter's session (the core put ``adapter`` in its body)."""
    if not (isinstance(step, steps.End) or (isinstance(step, steps.EngineVerb) and step.verb == ec.BEGIN)):
        return False
    return isinstance(step.body, dict) and step.body.get(ADAPTER_KEY) is not None


def _lora_requests(scope: dict) -> dict:
    """vLLM's API server registry of loaded adapters (``OpenAIServingModels.lora_requests``)."""
    models = getattr(scope["app"].state, "openai_serving_models", None)
    return dict(getattr(models, "lora_requests", None) or {})


def _lora_id(scope: dict, name: str) -> int:
    """vLLM's int id of adapter ``name``; InvalidRequest naming the loaded ones when vLLM has not loaded it."""
    loaded = _lora_requests(scope)
    if name not in loaded:
        raise InvalidRequest(f"vLLM has not loaded it (loaded: {', '.join(sorted(loaded)) or 'none'})", parameter=name)
    return int(loaded[name].lora_int_id)


def _api_servers(scope: dict) -> int:
    args = getattr(scope["app"].state, "args", None)
    return int(getattr(args, "api_server_count", None) or 1)


def _rank_param(scope: dict) -> int:
    from urllib.parse import parse_qs

    values = parse_qs((scope.get("query_string") or b"").decode("latin-1")).get("rank", ["0"])
    if not values[0].isdigit():
        raise InvalidRequest(f"rank must be an integer >= 0, got {values[0][:20]!r}")
    return int(values[0])
