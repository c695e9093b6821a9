"""Control-plane client for vLLM 0.33 engines running the ``p2pweights`` backend and its session gate
(docs/vllm.md, "Senders and vLLM engines").

:class:`VllmEngine` is an :class:`~.sglang.SglangEngine` whose verbs go to vLLM's routes, so the
update session (``update_session.py``), the lease renewer, deltas and ``verify=True`` drive a vLLM
engine through the same code paths as an sglang one. The whole mapping is :data:`VERBS`: the
sglang verb each path of the session calls, and the vLLM route (or the gate's own) that does it.

:meth:`VllmEngine.server_info` gathers what connect reads of the engine (vLLM's ``/server_info`` with
``config_format=json``, ``/get_world_size``, rank 0's publication); ``sender/engine_kinds.py`` makes
the engine's layout of it, or of ``layout=`` when given.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import EngineError, InvalidRequest
from . import bodies, routes
from . import protocol as p
from .routes import Route
from .sglang import SglangEngine

_G, _P = ("GET",), ("POST",)

#: verbs whose route a vLLM engine with the gate serves at sglang's path (the gate's own routes, and
#: vLLM's /server_info and /update_weight_version)
SHARED = ("server_info", "remote_instance_transfer_engine_info", "update_weight_version", "renew_weight_update",
          "p2pw_weights_digest", "p2pw_apply_deltas")

#: sglang's verb -> the vLLM route that does it
VERBS: dict[str, Route] = {**{v: routes.route(v) for v in SHARED}, **{r.verb: r for r in (
    Route("get_world_size", "/get_world_size", "GET", _G),
    Route("model_info", "/weight_info", "GET", _G),
    Route("is_paused", "/is_paused", "GET", _G),
    Route("pause_generation", "/pause", "POST", _P, query=("mode",)),
    Route("continue_generation", "/resume", "POST", _P),
    Route("begin_weight_update", "/start_weight_update", "POST", _P),
    Route("end_weight_update", "/finish_weight_update", "POST", _P),
    Route("weights_checker", "/weight_checker", "POST", _P),
    Route("weight_update_state", "/p2pw_weight_update", "GET", _G),
    # LoRA adapters: vLLM's own load (the gate pins it when asked: ``pinned``) and unload (docs/lora.md)
    Route("load_lora_adapter", "/v1/load_lora_adapter", "POST", _P),
    Route("unload_lora_adapter", "/v1/unload_lora_adapter", "POST", _P),
)}}

#: sglang's pause modes -> vLLM's (abort, wait, keep): requests sglang keeps (in_place, retract) vLLM keeps
#: queued (keep); vLLM's own modes pass as they are
PAUSE_MODES = {"abort": "abort", "in_place": "keep", "retract": "keep", "wait": "wait", "keep": "keep"}

#: what the gate enforces, in the sglang plugin's words (owner rules, the digest, deltas)
GATE_OFFERS = frozenset({p.PLUGIN_SESSIONS, p.PLUGIN_DIGEST, p.PLUGIN_DELTAS})


@dataclass
class VllmBody(bodies.Body):
    """A vLLM route's JSON object as it is (vLLM's routes take embedded fields, not sglang's bodies)."""

    SGLANG: ClassVar[str | None] = None
    fields: dict = field(default_factory=dict, metadata={"extra": True})


class VllmEngine(SglangEngine):
    """One vLLM engine's control plane (module docstring). ``url``: vLLM's API server; ``api_key``:
    its ``--api-key`` (the gate needs it on every weight route); ``layout``: the engine's layout when
    it should not be read from ``/server_info`` (a VllmLayout or ``"tp=2,deep_gemm=0"``)."""

    engine_kind = "vllm"

    def __init__(self, base_url: str, *, api_key: str | None = None, layout: Any = None, name: str | None = None,
                 timeout: float | None = None, connect_timeout: float | None = None):
        super().__init__(base_url, name=name, timeout=timeout, connect_timeout=connect_timeout, api_key=api_key)
        self.given_layout = layout  # read by connect (sender/engine_kinds.py), which builds the VllmLayout
        self.plugin_offers = GATE_OFFERS

    def _route(self, verb: str) -> Route:
        try:
            return VERBS[verb]
        except KeyError:
            raise KeyError(f"{verb!r} has no vLLM route ({', '.join(VERBS)})") from None

    # ---- what connect reads ---------------------------------------------------------------------
    def server_info(self) -> dict:
        """What connect needs, in the keys it reads from an sglang ``/server_info``: ``p2pw_transport``,
        ``vllm_version`` and ``device_arch`` (rank 0's publication), ``world_size`` (``/get_world_size``),
        ``vllm_server_info`` (vLLM's ``/server_info?config_format=json``; None when a layout was given) and
        ``p2pw_weight_update`` (the gate's session state, with the engine's ``instance``)."""
        pub = self.transfer_engine_info(0)
        world = self._json("get_world_size")
        config = None if self.given_layout is not None else self._json(
            "server_info", params={"config_format": "json"})
        if not isinstance(pub, dict) or not isinstance(world, dict):
            raise EngineError(f"engine {self.name}: its publication or /get_world_size is not a JSON object",
                              engine=self.name)
        self.plugin_offers = GATE_OFFERS
        return {"engine_kind": "vllm", "p2pw_transport": pub.get("transport"), "vllm_version": pub.get("vllm_version"),
                "device_arch": pub.get("device_arch"), "world_size": world.get("world_size"),
                "vllm_server_info": config, "p2pw_weight_update": self._json("weight_update_state")}

    def weight_version(self) -> str:
        return str(self.model_info().get("weight_version"))

    # ---- the session verbs, on vLLM's routes ------------------------------------------------------
    def pause_generation(self, mode: str = "abort") -> dict:
        """``POST /pause?mode=``: sglang's abort / in_place / retract are vLLM's abort / keep / wait."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: a vLLM engine takes {', '.join(PAUSE_MODES)}")
        return self._json("pause_generation", params={"mode": PAUSE_MODES[mode]})

    def continue_generation(self, torch_empty_cache: bool = True) -> dict:
        return self._json("continue_generation")

    def is_paused(self) -> bool:
        return bool(self._json("is_paused").get("is_paused"))

    def begin_weight_update(self, selector: str = "all", lease: float | None = None) -> dict:
        """``POST /start_weight_update`` (the gate: owner, lease, a delta claim in ``begin_extra``)."""
        if selector != "all":
            raise InvalidRequest(f"engine {self.name}: selector {selector!r}: the vLLM backend updates the "
                                 f"target model only (draft updates are not supported)")
        lease_header = {p.SESSION_LEASE_HEADER: f"{float(lease):g}"} if lease is not None else None
        return self._json("begin_weight_update", body=VllmBody(dict(self.begin_extra)), headers=lease_header)

    def end_weight_update(self, then_version: str | None = None, then_continue: bool = True,
                          torch_empty_cache: bool = True) -> dict:
        """``POST /finish_weight_update`` (delta manifests in ``end_extra``); vLLM's post-processing runs.
        The version is bumped apart (``update_weight_version``): the gate never answers END_FOLDS."""
        if then_version is not None:
            raise InvalidRequest(f"engine {self.name}: a vLLM engine's finish does not fold the version and resume")
        return self._json("end_weight_update", body=VllmBody(dict(self.end_extra)))

    def update_weight_version(self, version: str | int) -> dict:
        return self._json("update_weight_version", body=VllmBody({"new_version": str(version)}))

    def load_lora_adapter(self, name: str, path: str, pinned: bool = True) -> dict:
        """``POST /v1/load_lora_adapter {"lora_name", "lora_path", "pinned"}``: vLLM's own load of a PEFT
        adapter from files (vLLM picks the slot); ``pinned``: the gate then runs vLLM's ``pin_lora``, so
        vLLM never evicts it, which ``sender.update(step, adapter=name)`` needs. Answers ``lora_int_id``
        and, pinned, ``p2pw_slot``."""
        return self._json("load_lora_adapter", body=VllmBody({"lora_name": str(name), "lora_path": str(path),
                                                              "pinned": bool(pinned)}))

    def unload_lora_adapter(self, name: str) -> dict:
        """``POST /v1/unload_lora_adapter {"lora_name"}`` (the gate has the workers drop it too: its slot is freed)."""
        return self._json("unload_lora_adapter", body=VllmBody({"lora_name": str(name)}))

    def weights_checker(self, action: str = "checksum", **extra: Any) -> dict:
        """vLLM's ``POST /weight_checker {"action"}``: ``checksum`` answers SHA-256 per parameter."""
        return self._json("weights_checker", body=VllmBody({"action": action, **extra}))

