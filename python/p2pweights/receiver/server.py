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
the ranks registered: ``version`` (as sglang's does) and ``p2pw_device_archs`` (:mod:`.build_report`).

State: ``generating`` -> ``pause_generation`` -> ``paused`` -> ``begin_weight_update`` ->
``updating`` -> ``end_weight_update`` -> ``paused`` -> ``update_weight_version`` ->
``continue_generation`` -> ``generating``. Out-of-order calls answer 400 with sglang's body
``{"success": false, "message": ...}`` (plus p2pweights' ``error`` object: every error answer is
``control.error_answers.error_payload``). Stricter than sglang, because one-sided writes land in live
parameter memory: ``begin_weight_update`` needs the engine paused, and ``update_weight_version``
is refused while an update session is open (the version is bumped only after the update ended).

Also served, for the broadcast baseline (``p2pweights.baseline.broadcast``): sglang's
``/init_weights_update_group``, ``/update_weights_from_distributed`` (only inside an update session,
as in sglang 0.5.23) and ``/destroy_weights_update_group``, through the hooks of the same names.
A registration may carry extra publication keys (NIXL's ``transport``, ``agent_metadata``,
``location``), served next to ``remote_instance_transfer_engine_info``; keys starting with ``p2pw_``
only reach the ``on_register_transfer_engine_info`` hook. docs/receiver.md has the details.

Routes, bodies, status codes and the error payload are ``p2pweights.control``'s (``routes``,
``bodies``, ``protocol``, ``error_answers``); the hooks interface is :mod:`.hooks`'s; one HTTP
request's way to a verb here is :mod:`.request_handler`'s.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
import time
import traceback
from typing import Any

from ..control import bodies
from ..control import protocol as p
from ..control.weights_digest import ALGORITHM
from ..engine import steps
from ..engine.adapters import ADAPTER_KEY
from ..engine.core import EngineCore
from ..errors import InvalidRequest
from ..front import BackgroundServer
from ..front import guard as front_guard
from ..front import workers as front_workers
from ..settings import value as setting
from . import phases
from .hooks import ReceiverHooks
from .request_handler import Refused, build_app, error_answer

logger = logging.getLogger(__name__)

_ALREADY_OPEN = "p2pw_already_open"  # how _begin_weight_update tells the core its own session is open


class ReceiverServer:
    """``ReceiverServer(hooks, host="127.0.0.1", port=0)``; ``.start()``, ``.url``, ``.close()``.

    ``port=0`` picks a free port (read it from ``.url`` / ``.port`` after ``start``).
    ``weight_version`` is the version reported before the first update (sglang's default: "default").
    ``api_key`` (default ``P2PW_API_KEY``): every route but the health routes answers 401 without
    ``Authorization: Bearer KEY`` (sglang's ``--api-key``). ``max_body``: bytes a request body may
    have (413 above it, unread when its Content-Length says so); ``read_timeout``: seconds one read
    of a request's body may wait, and an idle kept-alive connection stays open (408 for a stalled
    body); ``request_deadline``: seconds a request's head may take to arrive (then the connection is
    closed), and then its whole body (408); ``max_connections``: verbs of keyed requests that run at
    once, each on a worker thread (more wait their turn, none is refused; requests without the key,
    the health routes, have a few threads of their own); ``max_connections_per_client``: accepted
    and unused (connections are no longer capped: an idle or dripping one costs no thread, and
    the deadlines close it). The HTTP front (``p2pweights.front``) does all of this. ``session_lease`` (default
    ``P2PW_SESSION_LEASE``): the longest lease this engine grants a weight-update session's owner
    (``engine/session.py``).
    """

    def __init__(self, hooks: ReceiverHooks | None = None, host: str = "127.0.0.1", port: int = 0, *,
                 weight_version: str = "default", api_key: str | None = None,
                 max_body: int = front_guard.MAX_BODY_BYTES, read_timeout: float = front_guard.READ_TIMEOUT,
                 request_deadline: float = front_guard.REQUEST_DEADLINE,
                 max_connections: int = front_workers.KEYED_WORKERS, max_connections_per_client: int | None = None,
                 session_lease: float | None = None):
        self.hooks = hooks if hooks is not None else ReceiverHooks()
        self.api_key: str | None = setting("P2PW_API_KEY", api_key)
        self.max_body = int(max_body)
        self.read_timeout = float(read_timeout)
        self.request_deadline = float(request_deadline)  # a request's head, then its body (p2pweights.front)
        self.max_connections = int(max_connections)  # worker threads for keyed requests' verbs
        self.max_connections_per_client = max_connections_per_client  # unused: connections are not capped
        self.host = host
        self._requested_port = int(port)
        self._front: BackgroundServer | None = None  # uvicorn on its own thread and event loop
        self._state_lock = threading.Lock()      # guards the fields below; held only briefly
        self._control_lock = threading.RLock()   # one control hook at a time (the core's verbs run one at a time too)
        # every engine-side decision (session, lease, epoch, the tear rule, the delta base): engine/core.py;
        # begin answers protocol.BEGIN_PAUSES (the owner's next begin may pause first) with P2PW_RECEIVER_CONTROL
        self.core = EngineCore(lease=session_lease, begin_pauses=setting("P2PW_RECEIVER_CONTROL") == "folded",
                               end_folds=True)
        self.session, self.base = self.core.session, self.core.base
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
        if self._front is not None:
            return self
        # returns once the port is bound and served (a port taken raises OSError here)
        self._front = BackgroundServer(build_app(self), self.host, self._requested_port, read_timeout=self.read_timeout,
                                       request_deadline=self.request_deadline, name="p2pweights-receiver").start()
        self.core.engine = self.url
        logger.info("p2pweights receiver control server on %s", self.url)
        return self

    @property
    def port(self) -> int:
        if self._front is None:
            raise RuntimeError("ReceiverServer is not started; call start()")
        return self._front.port

    @property
    def url(self) -> str:
        host = self.host if self.host not in ("0.0.0.0", "") else "127.0.0.1"
        return f"http://{host}:{self.port}"

    @property
    def _connections(self) -> list:
        """The client address of each connection open now (kept alive between calls, or in a request)."""
        return self._front.open_connections() if self._front is not None else []

    def close(self) -> None:
        """Stop serving, close every connection (kept-alive ones too: none reaches this closed
        server's state) and free the port; joins the server's thread. Idempotent."""
        self._closed = True
        front, self._front = self._front, None
        if front is not None:
            front.close()

    def __enter__(self) -> "ReceiverServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_front", None) is not None:
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

    def _revoke(self, epoch: int) -> int | None:
        """The core's :class:`~p2pweights.engine.steps.Revoke`: every rank moves its registrations to a new
        endpoint under ``epoch`` (``hooks.on_revoke``), and what is published becomes theirs; the lost
        owner's connections and keys fail (docs/security.md, "Epochs"). None where the hooks cannot
        revoke (the engine's fence is then the senders' alone)."""
        published = self.hooks.on_revoke(epoch)
        if published is None:
            return None
        with self._state_lock:
            for rank, (peer, table, extra) in published.items():
                kept = {k: v for k, v in self._registered_extra.get(int(rank), {}).items() if k == "registered_from"}
                self._registered[int(rank)] = [peer, table]
                self._registered_extra[int(rank)] = {**{k: v for k, v in extra.items() if not k.startswith("p2pw_")},
                                                     **kept}
        return epoch

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

    # ---- the engine core's verbs, mapped onto the hooks --------------------------------------

    def state(self) -> str:
        if self.updating:
            return "updating"
        return "paused" if self.paused else "generating"

    def control(self, verb: str, headers: Any, body: Any) -> tuple[int, Any]:
        """One call of a verb the engine core decides (``engine.core.VERBS``): (status, answer)."""
        answer = self.core.run(verb, headers, body, self._step)
        return answer.status, answer.body

    def _step(self, step: steps.Step) -> Any:
        """One step the core asks for, done by the hooks (``engine/steps.py``)."""
        if isinstance(step, steps.IsPaused):
            return self.paused
        if isinstance(step, steps.DeltaSupport):
            return self._delta_support()
        if isinstance(step, steps.PublishedEpochs):
            return [e.get("epoch") for e in self.registered_extras().values()]
        if isinstance(step, steps.Revoke):
            return self._revoke(step.epoch)
        if isinstance(step, steps.ApplyDeltas):
            return self.hooks.on_apply_deltas(step.manifests)
        if isinstance(step, steps.End):
            return self._end(step.manifests, adapter=(step.body or {}).get(ADAPTER_KEY))
        if isinstance(step, steps.AdapterSlot):
            return self.hooks.adapter("slot", step.name)
        t0 = time.perf_counter()
        status, answer = getattr(self, "_" + step.verb)(step.body or {})
        phases.record_phase(f"{step.verb}_s", time.perf_counter() - t0)
        already_open = bool(answer.pop(_ALREADY_OPEN, False)) if isinstance(answer, dict) else False
        return steps.Answer(status, answer, already_open=already_open)

    def _pause_generation(self, body: dict) -> tuple[int, dict]:
        req = bodies.decode(bodies.PauseGenerationReq, body)
        with self._control_lock:
            self.hooks.on_pause(req.mode)     # idempotent, like sglang: pausing a paused engine is fine
            self.paused = True
        return p.OK, bodies.encode(bodies.GenerationAck("Generation paused successfully."))

    def _continue_generation(self, body: dict) -> tuple[int, dict]:
        req = bodies.decode(bodies.ContinueGenerationReq, body)
        with self._control_lock:
            self.hooks.on_continue(req.torch_empty_cache)
            self.paused = False
        return p.OK, bodies.encode(bodies.GenerationAck("Generation continued successfully."))

    def _begin_weight_update(self, body: dict) -> tuple[int, dict]:
        req = bodies.decode(bodies.BeginWeightUpdateReq, body)
        with self._control_lock:
            if self.updating:  # torn: the lost owner's session is still open here; the core decides
                return p.BAD_REQUEST, {"success": False, "message": f"a weight-update session is {p.SESSION_ALREADY_OPEN}",
                                       _ALREADY_OPEN: True}
            if req.extra.get(ADAPTER_KEY) is None:  # an adapter's slot needs none of the weights' hooks
                self.hooks.on_begin_update(req.selector)
            self.updating, self.update_selector = True, req.selector
        return p.OK, bodies.encode(bodies.Ack())

    def _delta_support(self) -> str:
        """Why this engine cannot take deltas now ("" when it can): every rank must publish a delta area."""
        if type(self.hooks).on_apply_deltas is ReceiverHooks.on_apply_deltas:
            return "this engine's hooks apply no deltas"
        extras = self.registered_extras()
        missing = sorted(r for r, e in extras.items() if not e.get("delta_area"))
        if not extras or missing:
            return f"engine rank(s) {missing or 'none'} publish no delta area"
        return ""

    def _end(self, manifests: dict[int, dict] | None, adapter: str | None = None) -> steps.Answer:
        with self._control_lock:
            if adapter is not None:
                pass  # sglang runs nothing after an adapter's load either: the slot's bytes are what it serves
            elif manifests is None:
                self.hooks.on_end_update()
            else:  # applied, then post-processed: in one call to each rank where the hooks can
                self.hooks.on_apply_deltas_then_end(manifests)
            self.updating, self.update_selector = False, None
        return steps.Answer(p.OK, bodies.encode(bodies.Ack()))

    def _load_lora_adapter(self, body: dict) -> tuple[int, dict]:
        req = bodies.decode(bodies.LoadLoRAAdapterReq, body)
        with self._control_lock:
            try:
                slot = self.hooks.adapter("load", req.lora_name, req.lora_path, req.pinned)
            except NotImplementedError as e:  # sglang answers 400 too when LoRA is not enabled
                return _no_pool(e)
        return p.OK, {"success": True, "error_message": None, "loaded_adapters": {req.lora_name: req.lora_path},
                      "p2pw_slot": slot}

    def _unload_lora_adapter(self, body: dict) -> tuple[int, dict]:
        req = bodies.decode(bodies.UnloadLoRAAdapterReq, body)
        with self._control_lock:
            try:
                self.hooks.adapter("unload", req.lora_name)
            except NotImplementedError as e:
                return _no_pool(e)
        return p.OK, {"success": True, "error_message": None}

    def _update_weight_version(self, body: dict) -> tuple[int, dict]:
        req = bodies.decode(bodies.UpdateWeightVersionReq, body)
        with self._control_lock:
            self.hooks.on_weight_version(req.new_version, req.abort_all_requests)
            self.weight_version = req.new_version
        return p.OK, bodies.encode(bodies.WeightVersionAck(f"Weight version updated to {req.new_version}", req.new_version))

    def _renew_weight_update(self, body: dict) -> tuple[int, dict]:
        self.hooks.on_renew_lease()  # a stalled rank is named here, within the renewal's timeout
        return p.OK, {}

    def _weights_checker(self, req: bodies.CheckWeightsReq) -> tuple[int, dict]:
        # sglang's fields, then those it does not define (e.g. p2pweights' hf_seed) as they came
        request = {"action": req.action, "allow_quant_error": req.allow_quant_error,
                   "skip_tensor_list": req.skip_tensor_list, "selector": req.selector}
        request.update({k: v for k, v in req.extra.items() if k not in request})
        answer = dict(self.hooks.weights_checker(request))
        answer.setdefault("success", False)
        answer.setdefault("message", "")
        # sglang's answer either way (an unequal check is a result, not an error)
        return (p.OK if answer["success"] else p.BAD_REQUEST), answer

    def _weights_digest(self, req: bodies.WeightsDigestReq) -> tuple[int, dict]:
        try:
            names = {int(r): [str(n) for n in ns] for r, ns in req.names.items()}
        except (TypeError, ValueError):
            raise InvalidRequest("field 'names' must map an engine rank to a list of parameter names") from None
        try:  # not under the control lock: it only reads, and the caller wrote before asking
            digests = self.hooks.weights_digest(names)
        except NotImplementedError as e:
            raise Refused(str(e), p.NOT_IMPLEMENTED) from None
        return p.OK, {"success": True, "algorithm": ALGORITHM,
                      "ranks": {str(r): dict(d) for r, d in digests.items()}}

    def _get_weights_by_name(self, req: bodies.GetWeightsByNameReq) -> tuple[int, Any]:
        value = self.hooks.get_weights_by_name(req.name, req.truncate_size)
        if value is None:
            raise Refused("Get parameter by name failed", parameter=req.name)  # sglang's message
        if hasattr(value, "tolist"):
            value = value.tolist()
        return p.OK, value

    def _init_weights_update_group(self, body: dict) -> tuple[int, dict]:
        req = bodies.decode(bodies.InitWeightsUpdateGroupReq, body)
        try:  # not under the control lock: joining waits for every member, the sender included
            self.hooks.init_weights_update_group(dataclasses.asdict(req))
        except Exception as e:  # noqa: BLE001 - sglang answers 400 with the reason
            logger.error("init_weights_update_group failed: %s", e)
            return p.BAD_REQUEST, error_answer(e, f"Failed to initialize custom process group: {e}.")
        return p.OK, bodies.encode(bodies.Ack(message="Succeeded to initialize custom process group."))

    def _destroy_weights_update_group(self, body: dict) -> tuple[int, dict]:
        req = bodies.decode(bodies.DestroyWeightsUpdateGroupReq, body)
        try:
            self.hooks.destroy_weights_update_group(req.group_name)
        except Exception as e:  # noqa: BLE001
            return p.BAD_REQUEST, error_answer(e, f"Failed to destroy custom process group: {e}.")
        return p.OK, bodies.encode(bodies.Ack(message="Succeeded to destroy custom process group."))

    def _update_weights_from_distributed(self, body: dict) -> tuple[int, dict]:
        req = bodies.decode(bodies.UpdateWeightsFromDistributedReq, body)
        with self._control_lock:
            try:
                self.hooks.update_weights_from_distributed(dataclasses.asdict(req))
            except Exception as e:  # noqa: BLE001 - sglang answers 400 with the reason (the core tears)
                logger.error("update_weights_from_distributed failed:\n%s", traceback.format_exc())
                return p.BAD_REQUEST, error_answer(e, f"Failed to update parameter online: {e}")
            if req.weight_version is not None:
                self.weight_version = req.weight_version
        return p.OK, bodies.encode(bodies.Ack(message="Succeeded to update parameter online."))

    def _model_info(self) -> dict:
        info = dict(self.hooks.model_info())
        info["weight_version"] = self.weight_version
        return info


def _no_pool(e: NotImplementedError) -> tuple[int, dict]:
    return p.BAD_REQUEST, {"success": False, "error_message": f"{e}: start the engine with a LoRA setting "
                           "(start_engine(..., lora=LoRASetting(...)), serve --enable-lora); docs/lora.md"}
