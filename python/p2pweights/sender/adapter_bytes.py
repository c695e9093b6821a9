"""An adapter's slot bytes for one engine rank, by that engine's own adapter load run on the sender.

One function per engine question, so each engine kind answers in one place:

- :func:`adapter_setting`: the engine's LoRA setting and shard layout, from its ``/server_info``
  (sglang's fields; refused, naming the fix, when the engine was started without LoRA);
- :func:`slot_bytes`: ``{buffer name: uint8 array}`` of one adapter slot on one engine rank, made by
  the engine's own code (sglang: ``replica.lora_pool``, its ``LoRAManager`` and memory pool on CPU).
  The bytes of a slot do not depend on which slot it is: it is produced as slot 1.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from ..errors import LayoutMismatch
from ..models import resolve_model
from ..models.engine_layout import EngineLayout

if TYPE_CHECKING:
    import torch

    from ..replica.lora_layout import LoRASetting


def adapter_setting(engine: Any) -> tuple["LoRASetting", EngineLayout]:
    """An engine's LoRA setting and shard layout (module docstring)."""
    from ..replica.lora_layout import LoRASetting  # replica/ loads at an adapter's first update

    info = engine.server_info()
    try:
        return LoRASetting.from_server_info(info), EngineLayout.from_server_info(info)
    except LayoutMismatch as e:
        raise LayoutMismatch(f"engine {engine.name}: {e.message}", engine=engine.name, hint=e.hint) from None


def slot_bytes(sender: Any, engine: Any, rank: int, adapter_config: Mapping[str, Any],
               tensors: Mapping[str, "torch.Tensor"], name: str) -> dict[str, np.ndarray]:
    """One adapter slot's bytes on engine rank ``rank`` (module docstring); refuses (LayoutMismatch,
    one line naming the adapter, the module and the fix) an adapter the engine's pool cannot hold."""
    from ..replica.lora_pool import lora_pool_replica  # sglang's LoRA code: only for adapters
    from ..replica.lora_reference import sglang_lora_on_cpu

    setting, layout = sender.adapters.setting(engine)
    with sglang_lora_on_cpu():
        replica = lora_pool_replica(resolve_model(sender.model), setting, layout, rank)
        got = replica.adapter_slot_bytes(adapter_config, tensors, 1, name=name)
    return {b: v.numpy() for b, v in got.items()}
