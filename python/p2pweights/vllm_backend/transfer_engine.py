"""The ``p2pweights`` weight-transfer backend of vLLM 0.33 (``vllm.distributed.weight_transfer``):
what one vLLM worker does for one-sided updates. vLLM's worker creates it after loading the model
(``WeightTransferEngineFactory.create_engine``) and calls it for each weight-transfer RPC.

- ``init_transfer_engine`` registers the worker's parameter memory, where vLLM put it, and a delta
  area beside host-memory weights with Mooncake or NIXL (``rank_memory.RankMemory``, the receiver's
  revocable registrations) and builds the rank's publication. vLLM's init route answers only a
  message, so the publication reaches senders through the gate (``gate.py``), which asks every
  worker for it (:meth:`__call__`) and serves it only with the API key.
- ``start_weight_update`` checks the rank is registered; the session itself (owner, lease, torn,
  epoch) lives once per engine in the API server's gate.
- ``receive_weights``: one-sided writes need nothing here. Its ``update_info`` may carry only
  ``p2pw_delta`` (``{rank: manifest}``): this rank checks what its delta area holds against its
  manifest, whole, then applies it; any other field is refused.
- ``finish_weight_update`` runs vLLM's post-processing (``process_weights_after_loading``, the
  model loader's) and refuses a layout whose post-processing moved a parameter off its published
  memory.
- **A speculative draft** (vLLM's MTP drafter) is served with the target: vLLM hands the backend its
  drafter through ``set_weight_update_target`` (the gate has every worker run vLLM's own
  ``_set_draft_weight_update_target`` before the init: ``rank_calls.attach_drafts``); the init
  registers the draft's own parameters next to the target's, published as ``draft.<name>``
  (``rank_memory.ServedModels``), so one session writes both and one version labels both. Every
  finish post-processes both, whichever model vLLM's session targeted (``/start_weight_update`` or
  ``/start_draft_weight_update``: the writes go where the table says, not to vLLM's target).
- :meth:`__call__` (``verb``, ``body``): the gate's channel into the worker, through vLLM's
  ``collective_rpc("weight_transfer_engine", args=(verb, body))`` (vLLM's ``run_method`` takes the
  worker's attribute by name and calls it): ``publication``, ``revoke`` (a takeover's new epoch),
  ``digest`` (``verify=True``, ``control.weights_digest``; adapter slot entries too), ``adapter_slot``
  (the slot vLLM gave a LoRA adapter: ``rank_lora.py``), ``ping``.
- **LoRA** (``--enable-lora``): the init registers and publishes the LoRA tensors' slots with the
  weights (``rank_lora.AdapterSlots``); an adapter's session runs neither vLLM's start nor its finish
  (the gate skips them: no base weight changes, nothing to post-process).

This module imports vLLM: only vLLM's factory loads it (by name, from ``register()``).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from ..control.weights_digest import ALGORITHM, parameter_digests
from ..deltas.committed import DELTA_KEY
from ..errors import InvalidRequest
from .rank_lora import AdapterSlots, lora_manager, split_adapter_names
from .rank_memory import RankMemory, ServedModels

logger = logging.getLogger(__name__)

TRANSPORTS = ("mooncake", "nixl", "auto")


@dataclass
class P2PWeightsInitInfo(WeightTransferInitInfo):
    """``/init_weight_transfer_engine {"init_info": {...}}``: ``transport`` (mooncake, nixl, or auto:
    ``P2PW_TRANSPORT``'s rule), ``deltas`` (open a delta area beside host-memory weights),
    ``area_bytes`` (its size; None: ``P2PW_DELTA_AREA``, else an eighth of the weights)."""

    transport: str = "auto"
    deltas: bool = True
    area_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(f"init_info.transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if not isinstance(self.deltas, bool):
            raise ValueError(f"init_info.deltas must be true or false, got {self.deltas!r}")
        a = self.area_bytes
        if a is not None and (not isinstance(a, int) or isinstance(a, bool) or a <= 0):
            raise ValueError(f"init_info.area_bytes must be an integer > 0, got {a!r}")


@dataclass
class P2PWeightsUpdateInfo(WeightTransferUpdateInfo):
    """``/update_weights {"update_info": {"p2pw_delta": {"<rank>": manifest}}}``: the session's deltas
    (deltas/area.py ``Manifest``); an empty update_info is accepted and does nothing (the writes are
    one-sided). Unknown fields are refused (vLLM's ``parse_update_info``)."""

    p2pw_delta: dict | None = None

    def __post_init__(self) -> None:
        if self.p2pw_delta is not None and not isinstance(self.p2pw_delta, dict):
            raise ValueError(f"update_info.{DELTA_KEY} must be {{rank: manifest}}")


class P2PWeightsEngine(WeightTransferEngine[P2PWeightsInitInfo, P2PWeightsUpdateInfo]):
    """vLLM's worker side of p2pweights' one-sided updates (module docstring)."""

    init_info_cls = P2PWeightsInitInfo
    update_info_cls = P2PWeightsUpdateInfo
    # the drafter's parameters are registered and published with the target's (module docstring)
    supports_draft_weight_update = True

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.memory: RankMemory | None = None
        self.adapters: AdapterSlots | None = None
        self._init_info: P2PWeightsInitInfo | None = None
        self.rank = worker_rank(self.parallel_config)
        self.served = ServedModels(model, self.model_config)

    def set_weight_update_target(self, model: torch.nn.Module, model_config: Any) -> None:
        """vLLM points the backend at its drafter (``_set_draft_weight_update_target``): remembered as
        the draft this worker serves. Registered at the init; a drafter seen only after it is not."""
        if model is not self._default_model and self.served.draft is None:
            if self.memory is not None:
                raise InvalidRequest(f"rank {self.rank} registered its weights without its draft model: call "
                                     f"/shutdown_weight_transfer_engine, then /init_weight_transfer_engine again")
            self.served = ServedModels(self._default_model, self._default_model_config, model, model_config)
        super().set_weight_update_target(model, model_config)

    # ---- vLLM's verbs ---------------------------------------------------------------------------
    def init_transfer_engine(self, init_info: P2PWeightsInitInfo) -> None:
        self.reset_weight_update_target()  # the gate's attach_drafts left vLLM's target at the drafter
        if self.memory is not None:
            if init_info == self._init_info:
                return  # the same registration again (a trainer that reconnects): nothing to do
            raise InvalidRequest(f"rank {self.rank} is registered already ({self._init_info}); call "
                                 f"/shutdown_weight_transfer_engine before registering otherwise")
        import vllm

        manager = lora_manager(self._default_model)  # --enable-lora: the LoRA slots, with the weights
        self.adapters = AdapterSlots(manager, self.rank) if manager is not None else None
        self.memory = RankMemory(self.served, init_info.transport, self.rank, f"vllm pid {os.getpid()}",
                                 deltas=init_info.deltas, area=init_info.area_bytes,
                                 build={"vllm_version": str(vllm.__version__)}, adapters=self.adapters)
        self._init_info = init_info
        logger.info("p2pweights: rank %d registered %d bytes of weights%s in %d range(s) with %s (epoch %d)",
                    self.rank, sum(n for _, n in self.memory.regions),
                    " (target and draft)" if self.served.draft is not None else "", len(self.memory.regions),
                    self.memory.transport, self.memory.epoch)

    def start_weight_update(self) -> None:
        self._registered()

    def receive_weights(self, update_info: P2PWeightsUpdateInfo) -> None:
        if update_info.p2pw_delta is not None:
            applied = self._registered().apply_deltas(update_info.p2pw_delta)
            logger.info("p2pweights: rank %d applied its deltas: %s", self.rank, applied)

    def update_weights(self, update_info: dict) -> None:
        """vLLM's parse and receive, then a wait for the device the weights are on (vLLM's base class
        waits on ``torch.accelerator``, which a host-memory rank has none of)."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def finish_weight_update(self) -> None:
        memory = self._registered()
        self.served.post_process(self.device)
        memory.check_in_place()

    def shutdown(self) -> None:
        if self.memory is not None:
            self.memory.close()
            self.memory, self._init_info = None, None

    # ---- the gate's channel (collective_rpc "weight_transfer_engine") ----------------------------
    def __call__(self, verb: str, body: dict | None = None) -> Any:
        body = body or {}
        if verb == "ping":
            return {"rank": self.rank, "pid": os.getpid()}
        if verb == "publication":  # None: not registered yet (the gate answers that rank published nothing)
            return None if self.memory is None else {"rank": self.rank, **self.memory.publication()}
        if verb == "revoke":
            return {"rank": self.rank, **self._registered().revoke(int(body["epoch"]))}
        if verb == "digest":
            names, slots = split_adapter_names((body.get("names") or {}).get(str(self.rank), []))
            digests = parameter_digests(self.served, names, engine="vllm", rank=self.rank)
            if slots:
                digests.update(self._adapter_slots().digest(slots))
            return {"rank": self.rank, "algorithm": ALGORITHM, "digests": digests}
        if verb == "adapter_slot":  # the slot vLLM gave an adapter (the gate's steps.AdapterSlot)
            return self._adapter_slots().slot(int(body["lora_int_id"]), str(body.get("lora_name") or ""))
        raise InvalidRequest(f"unknown p2pweights verb {verb!r}")

    def _adapter_slots(self) -> AdapterSlots:
        self._registered()
        if self.adapters is None:
            raise InvalidRequest(f"rank {self.rank} runs without LoRA: no adapter slots",
                                 hint="start vLLM with --enable-lora (--max-lora-rank, --max-loras)")
        return self.adapters

    def _registered(self) -> RankMemory:
        if self.memory is None:
            raise InvalidRequest(f"rank {self.rank} has registered no weights: call /init_weight_transfer_engine "
                                 f"with the p2pweights backend first")
        return self.memory


def worker_rank(parallel_config: Any) -> int:
    """This worker's rank as vLLM indexes ``update_weights`` lists: ``data_parallel_index *
    world_size + rank``, ``rank`` its rank among its own DP rank's workers. An MoE engine's DP ranks
    share one world group (its rank there counts the DP ranks before it: taken modulo the DP rank's
    size); a dense engine's DP ranks are independent engines, each its own world."""
    from vllm.distributed import parallel_state

    world, size = parallel_state._WORLD, int(parallel_config.world_size)
    rank = int(world.rank_in_group) % size if world is not None else 0
    return int(getattr(parallel_config, "data_parallel_index", 0) or 0) * size + rank
