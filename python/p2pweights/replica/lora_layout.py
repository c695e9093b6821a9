"""sglang's LoRA memory pool on one engine rank, as data: its buffers and each adapter slot's bytes in them.

An sglang engine started with ``--enable-lora`` preallocates, before the KV cache, one zeroed
tensor per (target module, layer, A or B): ``A_buffer[module][layer]`` of shape
``[max_loras_per_batch, c*max_lora_rank, in_local]`` and ``B_buffer[module][layer]`` of shape
``[max_loras_per_batch, out_local, max_lora_rank]`` (MoE modules add an expert dimension after the
slot). Slot ``s`` of a buffer is its ``s``-th row along dim 0: one contiguous block of
``buffer.nbytes / max_loras_per_batch`` bytes at offset ``s * that``. The pool never reallocates;
sglang's own adapter load copies into these views (docs/lora.md).

This module holds the description only (no torch, no sglang): :class:`LoRASetting` (the engine's
LoRA server args), :class:`AdapterBuffer`, :class:`AdapterSlotRegion`, :class:`LoRAPoolLayout`, and
the refusals of an adapter the pool cannot hold. ``replica/lora_pool.py`` builds them by running
sglang's own ``LoRAManager`` on CPU and produces a slot's bytes with sglang's own load.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..errors import LayoutMismatch

#: sglang's ``--lora-target-modules`` for the dense projections of a Llama/Qwen-style decoder layer
DENSE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: sglang's and vLLM's LoRA wrappers hold the wrapped layer as ``base_layer``: its parameters are the model's own
LORA_WRAPPED = ".base_layer."


def base_name(name: str) -> str:
    """A parameter's name as the model without LoRA wrappers has it (what a rank publishes, the
    sender's replica and the checkpoint loaders name it): ``...qkv_proj.base_layer.weight`` ->
    ``...qkv_proj.weight``."""
    return name.replace(LORA_WRAPPED, ".")


@dataclass(frozen=True)
class LoRASetting:
    """The server args that decide an sglang engine's LoRA pool (every rank of it).

    ``target_modules`` as given to ``--lora-target-modules`` (HF names such as ``q_proj``, or
    ``all``); ``dtype`` as ``--dtype`` (the pool's dtype is the model's); ``lora_backend`` does
    not change the pool's layout, only which kernels read it."""

    max_lora_rank: int
    target_modules: tuple[str, ...] = DENSE_TARGETS
    max_loras_per_batch: int = 8
    dtype: str = "auto"
    lora_backend: str = "csgmv"

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if int(self.max_lora_rank) < 1 or int(self.max_loras_per_batch) < 1:
            raise ValueError(f"LoRA setting needs max_lora_rank >= 1 and max_loras_per_batch >= 1: {self}")

    @classmethod
    def from_server_info(cls, info: Mapping[str, Any]) -> "LoRASetting":
        """From an engine's ``GET /server_info`` (its resolved server args)."""
        if not info.get("enable_lora"):
            raise LayoutMismatch("the engine was not started with --enable-lora: it has no LoRA pool",
                                 hint="start it with --enable-lora --max-lora-rank R --lora-target-modules ...")
        return cls(
            max_lora_rank=int(info["max_lora_rank"]),
            target_modules=tuple(info.get("lora_target_modules") or ()),
            max_loras_per_batch=int(info.get("max_loras_per_batch") or 8),
            dtype=str(info.get("dtype") or "auto"),
            lora_backend=str(info.get("lora_backend") or "csgmv"),
        )

    def server_args(self) -> dict[str, Any]:
        """Keyword arguments for sglang's ``ServerArgs``."""
        return {
            "enable_lora": True,
            "max_lora_rank": int(self.max_lora_rank),
            "lora_target_modules": list(self.target_modules),
            "max_loras_per_batch": int(self.max_loras_per_batch),
            "dtype": self.dtype,
            "lora_backend": self.lora_backend,
        }

    def flags(self) -> str:
        """The setting as the engine's command line spells it (for messages)."""
        return (f"--max-lora-rank {self.max_lora_rank} --lora-target-modules {' '.join(self.target_modules)} "
                f"--max-loras-per-batch {self.max_loras_per_batch}")


@dataclass(frozen=True)
class AdapterSlotRegion:
    """One adapter slot's bytes inside one pool buffer: ``[offset, offset + nbytes)`` of the buffer."""

    buffer: str
    slot: int
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True)
class AdapterBuffer:
    """One tensor of sglang's LoRA pool on one rank: ``A_buffer[module][layer]`` or ``B_buffer[...]``.

    ``module`` is sglang's normalized name (``qkv_proj``, ``gate_up_proj``, ``o_proj``, ...);
    ``name`` is stable across processes: ``lora.A.qkv_proj.L3``."""

    name: str
    module: str
    layer: int
    side: str  # "A" or "B"
    shape: tuple[int, ...]
    dtype: str  # torch's name without "torch.": "bfloat16"
    nbytes: int

    @property
    def slots(self) -> int:
        return self.shape[0]

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one slot (the buffer is contiguous and slot-major)."""
        return self.nbytes // self.shape[0]

    def slot_region(self, slot: int) -> AdapterSlotRegion:
        if not 0 <= slot < self.slots:
            raise ValueError(f"{self.name}: slot {slot} is not a slot of a pool of {self.slots} slots")
        return AdapterSlotRegion(self.name, slot, slot * self.slot_nbytes, self.slot_nbytes)


def buffer_name(side: str, module: str, layer: int) -> str:
    return f"lora.{side}.{module}.L{layer}"


class AdapterBuffers:
    """What an engine rank's adapter buffers answer, whichever engine laid them out (sglang's pool
    here, vLLM's stacked tensors in vllm_lora.py): a subclass has ``buffers`` and ``_missing``."""

    buffers: tuple[AdapterBuffer, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    @property
    def slot_nbytes(self) -> int:
        """Bytes one adapter slot spans over all buffers (padding to max_lora_rank included)."""
        return sum(b.slot_nbytes for b in self.buffers)

    def buffer(self, name: str) -> AdapterBuffer:
        for b in self.buffers:
            if b.name == name:
                return b
        raise KeyError(self._missing(name))

    def slot_regions(self, slot: int) -> list[AdapterSlotRegion]:
        """Where adapter slot ``slot`` lives: one region per buffer, in :attr:`buffers` order."""
        return [b.slot_region(slot) for b in self.buffers]

    def _missing(self, name: str) -> str:
        raise NotImplementedError


@dataclass(frozen=True)
class LoRAPoolLayout(AdapterBuffers):
    """sglang's LoRA pool on one engine rank: every buffer, in (module name, layer, A before B) order.

    Slot 0 is the base model's (sglang zeroes it and routes requests without an adapter there);
    adapters occupy slots 1.. as sglang assigns them (``uid_to_buffer_id``)."""

    setting: LoRASetting
    tp_size: int
    tp_rank: int
    pool_modules: tuple[str, ...]  # sglang's normalized target modules of the pool
    buffers: tuple[AdapterBuffer, ...]

    @property
    def slots(self) -> int:
        return self.setting.max_loras_per_batch

    def _missing(self, name: str) -> str:
        return f"no LoRA pool buffer {name!r} on rank {self.tp_rank} (pool modules {list(self.pool_modules)})"


# -- what the pool cannot hold ---------------------------------------------------------------------
def adapter_modules(tensor_names: Iterable[str]) -> list[str]:
    """The HF module names a PEFT adapter's tensors adapt (``...mlp.down_proj.lora_A.weight`` ->
    ``down_proj``), in first-seen order."""
    seen: dict[str, None] = {}
    for name in tensor_names:
        head = name.split(".lora_", 1)[0] if ".lora_" in name else name.rsplit(".", 1)[0]
        seen.setdefault(head.rsplit(".", 1)[-1], None)
    return list(seen)


def refuse_rank(adapter: str, r: int, modules: list[str], setting: LoRASetting) -> None:
    """An adapter of rank ``r`` above the pool's ``max_lora_rank`` cannot fit its slot."""
    if r > setting.max_lora_rank:
        module = modules[0] if modules else "?"
        raise LayoutMismatch(
            f"LoRA adapter {adapter!r} has rank r={r} (module {module}"
            f"{' and ' + str(len(modules) - 1) + ' more' if len(modules) > 1 else ''}) but the engine's pool "
            f"holds at most --max-lora-rank {setting.max_lora_rank}",
            parameter=module,
            hint=f"restart the engine with --max-lora-rank {r} (or more), or train the adapter with r <= "
                 f"{setting.max_lora_rank}",
        )


def refuse_module(adapter: str, module: str, pool_module: str, setting: LoRASetting) -> None:
    """An adapter that adapts a module the engine was started without has no buffer to go to."""
    raise LayoutMismatch(
        f"LoRA adapter {adapter!r} adapts module {module} (sglang's {pool_module}) but the engine was started "
        f"with --lora-target-modules {' '.join(setting.target_modules)}",
        parameter=module,
        hint=f"restart the engine with {module} in --lora-target-modules (or 'all'), or train the adapter "
             f"without {module}",
    )
