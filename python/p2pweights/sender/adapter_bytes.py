"""An adapter's slot bytes for one engine rank, by that engine's own adapter load run on the sender.

One function per engine question, so each engine kind answers in one place:

- :func:`adapter_setting`: the engine's LoRA setting and shard layout, from its ``/server_info``
  (sglang's fields; vLLM's ``vllm_config.lora_config`` of ``/server_info?config_format=json``, and
  the layout connect reads; refused, naming the fix, when the engine was started without LoRA);
- :func:`slot_bytes`: ``{buffer name: uint8 array}`` of one adapter slot on one engine rank, made by
  the engine's own code (sglang: ``replica.lora_pool``, its ``LoRAManager`` and memory pool on CPU;
  vLLM: ``replica.vllm_lora``, its ``LRUCacheLoRAModelManager`` and LoRA tensors on CPU, named as
  the vLLM backend's workers publish them, ``vllm_backend/rank_lora.py``). The bytes of a slot do
  not depend on which slot it is: it is produced as slot 1 (sglang; slot 0 is its base model's) or
  slot 0 (vLLM).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from ..errors import LayoutMismatch
from ..models import resolve_model
from ..models.engine_layout import EngineLayout
from .engine_kinds import is_vllm, vllm_layout

if TYPE_CHECKING:
    import torch

    from ..replica.lora_layout import LoRASetting


def adapter_setting(engine: Any) -> tuple["LoRASetting", EngineLayout]:
    """An engine's LoRA setting and shard layout (module docstring)."""
    from ..replica.lora_layout import LoRASetting  # replica/ loads at an adapter's first update

    info = engine.server_info()
    if is_vllm(engine):
        return vllm_lora_setting(engine, info), vllm_layout(engine, info)
    try:
        return LoRASetting.from_server_info(info), EngineLayout.from_server_info(info)
    except LayoutMismatch as e:
        raise LayoutMismatch(f"engine {engine.name}: {e.message}", engine=engine.name, hint=e.hint) from None


def vllm_lora_setting(engine: Any, info: Mapping[str, Any]) -> Any:
    """A vLLM engine's LoRA flags (``VllmLoRASetting``) from vLLM's ``lora_config`` in
    ``/server_info?config_format=json`` (asked for here when the client was given a layout)."""
    from ..replica.vllm_lora import VllmLoRASetting  # replica/ loads at an adapter's first update

    raw = info.get("vllm_server_info") or engine._json("server_info", params={"config_format": "json"})
    config = raw.get("vllm_config") if isinstance(raw, dict) else None
    lora = config.get("lora_config") if isinstance(config, dict) else None
    if not isinstance(lora, dict):
        raise LayoutMismatch(f"engine {engine.name}: vLLM runs without LoRA (its /server_info has no lora_config): "
                             f"it has no adapter slots to write", engine=engine.name,
                             hint="start vLLM with --enable-lora (--max-lora-rank, --max-loras)")
    targets = lora.get("target_modules")
    try:
        return VllmLoRASetting(max_lora_rank=int(lora["max_lora_rank"]), max_loras=int(lora["max_loras"]),
                               target_modules=tuple(targets) if targets else None,
                               lora_dtype=str(lora.get("lora_dtype") or "auto").removeprefix("torch."),
                               fully_sharded_loras=bool(lora.get("fully_sharded_loras")))
    except (KeyError, TypeError, ValueError) as e:
        raise LayoutMismatch(f"engine {engine.name}: vLLM's lora_config is not usable ({type(e).__name__}: {e})",
                             engine=engine.name) from None


def slot_bytes(sender: Any, engine: Any, rank: int, adapter_config: Mapping[str, Any],
               tensors: Mapping[str, "torch.Tensor"], name: str) -> dict[str, np.ndarray]:
    """One adapter slot's bytes on engine rank ``rank`` (module docstring); refuses (LayoutMismatch,
    one line naming the adapter, the module and the fix) an adapter the engine's pool cannot hold."""
    if is_vllm(engine):
        return _vllm_slot_bytes(sender, engine, rank, adapter_config, tensors, name)
    from ..replica.lora_pool import lora_pool_replica  # sglang's LoRA code: only for adapters
    from ..replica.lora_reference import sglang_lora_on_cpu

    setting, layout = sender.adapters.setting(engine)
    with sglang_lora_on_cpu():
        replica = lora_pool_replica(resolve_model(sender.model), setting, layout, rank)
        got = replica.adapter_slot_bytes(adapter_config, tensors, 1, name=name)
    return {b: v.numpy() for b, v in got.items()}


def _vllm_slot_bytes(sender: Any, engine: Any, rank: int, adapter_config: Mapping[str, Any],
                     tensors: Mapping[str, "torch.Tensor"], name: str) -> dict[str, np.ndarray]:
    """vLLM's own adapter load (``replica.vllm_lora``) into slot 0 of the rank's LoRA tensors, read back.
    ``vllm_lora_on_cpu``: vLLM's CPU punica wrapper and no host-memory pinning while it runs (the
    replica is built and loaded on CPU; neither changes a byte of the slot: docs/lora.md, "vLLM")."""
    from ..replica.vllm_lora import vllm_lora_replica  # vLLM's LoRA code: only for adapters
    from ..replica.vllm_lora_reference import vllm_lora_on_cpu

    setting, layout = sender.adapters.setting(engine)
    with vllm_lora_on_cpu():
        replica = vllm_lora_replica(resolve_model(sender.model), setting, layout, rank)
        got = replica.adapter_slot_bytes(adapter_config, tensors, 0, name=name)
    return {b: v.numpy() for b, v in got.items()}
