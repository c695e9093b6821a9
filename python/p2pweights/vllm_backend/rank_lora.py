"""One vLLM worker's LoRA adapter slots as p2pweights publishes them (docs/lora.md, "vLLM").

A vLLM engine started with ``--enable-lora`` wraps its target linears when the model loads
(``LoRAModelRunnerMixin.load_lora_model``); vLLM's LoRA model manager (``model.lora_manager``, an
``LRUCacheLoRAModelManager``) allocates one tensor per (module, layer, slice, A or B), once, with
``max_loras`` slots along dim 0, and every later activation copies into them in place. This module:

- names them as the sender's replica does (``replica.vllm_lora.lora_tensors``: one naming) and
  publishes one table entry per slot and tensor, ``lora.{A|B}.{module}.s{slice}.L{layer}@{slot}``,
  slots ``0 .. max_loras-1`` (vLLM has no base-model slot); their memory is registered with the
  weights' (``rank_memory.RankMemory``: revoked and re-registered with them on a takeover);
- answers the slot vLLM's manager gave an adapter (by vLLM's int id, which the gate reads from the
  API server's registry): ``lora_index_to_id.index(id)``; an adapter vLLM holds but has not
  activated (evicted from its slots, or never asked for) is activated first, as a request for it
  would; one vLLM does not hold at all is refused, naming the fix;
- digests slot entries for ``verify=True``.

A pinned adapter (``pin_lora``, which the gate runs after vLLM's load when asked) is never evicted,
so its slot stays its own and vLLM never copies its own CPU copy of the adapter back over the bytes
a one-sided update wrote.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..control.weights_digest import digest as tensor_digest
from ..errors import InvalidRequest, UnknownParameter
from ..replica.vllm_lora import lora_tensors
from ..transport.publication import ADAPTER_SLOTS, merge_regions

if TYPE_CHECKING:
    import torch


def slot_entry(buffer: str, slot: int) -> str:
    """The weights-table name of one slot of one LoRA tensor (the receiver's scheme)."""
    return f"{buffer}@{int(slot)}"


def lora_manager(model: Any) -> Any:
    """vLLM's LoRA model manager of ``model`` (None: the engine runs without LoRA)."""
    return getattr(model, "lora_manager", None)


class AdapterSlots:
    """The LoRA tensors of one worker's model (module docstring)."""

    def __init__(self, manager: Any, rank: int):
        self.manager, self.rank = manager, int(rank)
        self.tensors = lora_tensors(manager)
        self.slots = int(manager.lora_slots)
        self._by_name = {b.name: t for b, t in self.tensors}

    def published(self) -> list[tuple[str, "torch.Tensor"]]:
        """(table name, tensor) of every slot of every LoRA tensor."""
        return [(slot_entry(b.name, s), t[s]) for b, t in self.tensors for s in range(self.slots)]

    def regions(self) -> list[tuple[int, int]]:
        """The LoRA tensors' byte ranges, merged where they touch (what is registered)."""
        return merge_regions((int(t.data_ptr()), int(t.numel()) * t.element_size()) for _, t in self.tensors)

    def slot(self, lora_int_id: int, name: str = "") -> dict:
        """The slot vLLM's manager gave adapter ``lora_int_id`` (activated first when vLLM holds it
        but not in a slot); InvalidRequest when vLLM does not hold it. ``pinned``: whether vLLM will
        never evict it."""
        manager, lora_id = self.manager, int(lora_int_id)
        what = f"LoRA adapter {name!r} (vLLM id {lora_id})" if name else f"LoRA adapter id {lora_id}"
        if lora_id not in manager.list_adapters():
            raise InvalidRequest(f"rank {self.rank}: vLLM holds no {what} (held: {sorted(manager.list_adapters())})",
                                 rank=self.rank, parameter=name or str(lora_id),
                                 hint="load it with vLLM's /v1/load_lora_adapter (pinned), then update it")
        if lora_id not in manager.lora_index_to_id:
            manager.activate_adapter(lora_id)  # as a request for it would: vLLM's first free (or LRU) slot
        return {"rank": self.rank, "slot": manager.lora_index_to_id.index(lora_id),
                "pinned": lora_id in manager._active_adapters.pinned_items}

    def digest(self, names: Sequence[str], engine: str = "vllm") -> dict[str, str]:
        """The digest of each named slot entry (``lora.A.qkv_proj.s0.L0@1``)."""
        out = {}
        for name in names:
            buffer, _, slot = name.rpartition("@")
            t = self._by_name.get(buffer)
            if t is None or not slot.isdigit() or int(slot) >= self.slots:
                raise UnknownParameter(f"engine {engine} rank {self.rank} has no adapter slot {name!r}",
                                       engine=engine, rank=self.rank, parameter=name)
            out[name] = tensor_digest(t[int(slot)])
        return out


def split_adapter_names(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(parameter names, adapter slot entries) of a digest request."""
    return [n for n in names if not n.startswith(ADAPTER_SLOTS)], [n for n in names if n.startswith(ADAPTER_SLOTS)]
