"""The control plane's route table: every route sglang 0.5.23 serves that p2pweights calls or a
receiver answers, with its verb, methods and body class (:mod:`.bodies`); p2pweights' own routes
are marked ``p2pw``. tests/test_engines_sglang_routes.py checks it against the installed sglang.
"""
from __future__ import annotations

from dataclasses import dataclass

from .bodies import (
    ApplyDeltasReq,
    BeginWeightUpdateReq,
    CheckWeightsReq,
    ContinueGenerationReq,
    DestroyWeightsUpdateGroupReq,
    EndWeightUpdateReq,
    GetWeightsByNameReq,
    InitWeightsUpdateGroupReq,
    LoadLoRAAdapterReq,
    PauseGenerationReq,
    RegisterTransferEngineInfoReq,
    RenewWeightUpdateReq,
    UnloadLoRAAdapterReq,
    UpdateWeightsFromDistributedReq,
    UpdateWeightVersionReq,
    WeightsDigestReq,
)

#: a receiver's leader reaches its other engine ranks at ``POST {RANK_ROUTE_PREFIX}<verb>`` (internal)
RANK_ROUTE_PREFIX = "/p2pw_rank/"


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
    # LoRA adapters: the engine's own load (it picks the slot) and unload (docs/lora.md)
    Route("load_lora_adapter", "/load_lora_adapter", "POST", _P, LoadLoRAAdapterReq),
    Route("unload_lora_adapter", "/unload_lora_adapter", "POST", _P, UnloadLoRAAdapterReq),
    # p2pweights' own (a receiver's): the session owner's lease
    Route("renew_weight_update", "/renew_weight_update", "POST", _P, RenewWeightUpdateReq, p2pw=True),
    # p2pweights' own: digests of what engine ranks hold, for update(verify=True)
    Route("p2pw_weights_digest", "/p2pw_weights_digest", "POST", _P, WeightsDigestReq, p2pw=True),
    # p2pweights' own: the session's deltas applied before the digests (update(verify=True) with deltas)
    Route("p2pw_apply_deltas", "/p2pw_apply_deltas", "POST", _P, ApplyDeltasReq, p2pw=True),
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
