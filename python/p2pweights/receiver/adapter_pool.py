"""The LoRA adapter pool of one engine rank of the test/demo engines (receiver/rank.py), as sglang runs it.

An engine started with a LoRA setting (``start_engine(..., lora=LoRASetting(...))``) builds, next
to its model, sglang's own ``LoRAManager`` and ``LoRAMemoryPool`` for the rank
(``replica.lora_pool.LoRAPoolReplica``: sglang's code on this host), then moves every pool buffer into
one region of its own (host or GPU memory, as the weights), registered with the rank's transport
endpoint like the weights' region. Adapters are loaded by sglang's own load (``load_lora_adapter``,
pinned: the slot stays the adapter's), which picks the slot.

Each adapter slot of each buffer is published in the rank's weights table as
``lora.{A|B}.{module}.L{layer}@{slot}`` (slots 1..S-1; slot 0 is the base model's zeros): one
contiguous entry, so a sender writes an adapter's slot one-sided and the digest covers exactly that
slot. docs/lora.md, "Adapter updates".
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..control.weights_digest import digest as tensor_digest
from ..errors import UnknownParameter
from ..replica.lora_layout import LoRASetting
from ..replica.lora_pool import LoRAPoolReplica
from ..replica.lora_reference import sglang_lora_on_cpu
from .region import PARAM_ALIGNMENT, aligned_bytes

if TYPE_CHECKING:
    import torch

PREFIX = "lora."


def slot_entry(buffer: str, slot: int) -> str:
    """The weights-table name of one adapter slot of one pool buffer."""
    return f"{buffer}@{int(slot)}"


class AdapterPool:
    """sglang's LoRA pool of one engine rank, in a region of its own."""

    def __init__(self, config: str, engine: Any, rank: int, setting: LoRASetting, device: str = "cpu"):
        self.setting, self.rank, self.device = setting, int(rank), device
        with sglang_lora_on_cpu():
            self.pool = LoRAPoolReplica.build(config, setting, engine, rank)  # this engine's own, never shared
        buffers = self.pool.layout.buffers
        offsets, total = {}, 0
        for b in buffers:
            offsets[b.name] = total
            total += (b.nbytes + PARAM_ALIGNMENT - 1) // PARAM_ALIGNMENT * PARAM_ALIGNMENT
        self._raw, self.storage = aligned_bytes(max(total, 1), device)
        self.address, self.nbytes = int(self.storage.data_ptr()), int(total)

        def view(desc: Any, old: "torch.Tensor") -> "torch.Tensor":
            off = offsets[desc.name]
            return self.storage[off:off + desc.nbytes].view(old.dtype).view(old.shape)

        self.pool.rebind(view)

    @property
    def slots(self) -> int:
        return self.pool.layout.slots

    def published(self) -> list[tuple[str, "torch.Tensor"]]:
        """(table name, tensor) of every adapter slot of every buffer (slot 0 is not writable)."""
        return [(slot_entry(b.name, s), self.pool.slot_tensor(b.name, s))
                for b in self.pool.layout.buffers for s in range(1, self.slots)]

    # -- the engine's registry -----------------------------------------------------------------
    def load(self, name: str, path: str, pinned: bool) -> int:
        with sglang_lora_on_cpu():
            return self.pool.engine_load(name, path, pinned)

    def unload(self, name: str) -> None:
        self.pool.engine_unload(name)

    def slot(self, name: str) -> int:
        return self.pool.engine_slot(name)

    # -- reads -----------------------------------------------------------------------------------
    def digest(self, names: Sequence[str], engine: str) -> dict[str, str]:
        """The digest of each named adapter slot (``lora.A.qkv_proj.L0@1``)."""
        out = {}
        for name in names:
            buffer, _, slot = name.rpartition("@")
            try:
                t = self.pool.slot_tensor(buffer, int(slot))
            except (KeyError, ValueError):
                raise UnknownParameter(f"engine {engine} rank {self.rank} has no adapter slot {name!r}",
                                       engine=engine, rank=self.rank, parameter=name) from None
            out[name] = tensor_digest(t)
        return out

    def server_args(self) -> dict:
        """sglang's ``/server_info`` fields of the LoRA setting."""
        return self.setting.server_args()
