"""sglang's own LoRA pool of one engine rank, built in this process on CPU, and an adapter slot's bytes.

:class:`LoRAPoolReplica` builds the engine rank's model as sglang would with ``--enable-lora``
(``ServerArgs`` with the LoRA setting, the rank's runtime context with stand-in groups, the model
class on meta) and then sglang's own ``LoRAManager`` over it, which wraps the target modules and
allocates the ``LoRAMemoryPool``. The base model's parameters become CPU stand-ins of one element
each (``expand``: right shape, dtype and device, no storage): the pool is allocated on the base
model's device and no LoRA code reads a base weight. The pool itself is real CPU memory.

:meth:`LoRAPoolReplica.adapter_slot_bytes` runs sglang's own adapter load
(``load_lora_adapter_from_tensors``: config checks, q/k/v and gate/up stacking; then
``LoRAMemoryPool.load_lora_weight_to_buffer``: TP slicing by the wrapped layers, the copy into the
slot with the cast to the pool dtype) into the requested slot and reads that slot's bytes back.
Nothing of the layout is written here by hand; tests/test_lora_layout.py holds the bytes equal to
an engine-built pool's after the engine's own load from adapter files.

On a host without an accelerator, sglang's LoRA layers ask torch for pinned memory, which fails:
the caller provides that (tests/test_lora_layout.py patches ``pin_memory`` away in a fixture).

Public API::

    LoRAPoolReplica.build(config, setting, engine, rank)      # one engine rank's pool
    replica.layout -> LoRAPoolLayout                           # buffers, shapes, slot regions
    replica.adapter_slot_bytes(adapter_config, tensors, slot, name=...) -> {buffer name: uint8 tensor}
    lora_pool_replica(config, setting, engine, rank)           # the process's one per key (cached)
"""
from __future__ import annotations

import uuid
import warnings
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import LayoutMismatch, UnsupportedLayout
from ..models.engine_layout import EngineLayout
from . import sglang_env
from .lora_layout import (
    AdapterBuffer,
    LoRAPoolLayout,
    LoRASetting,
    adapter_modules,
    buffer_name,
    refuse_module,
    refuse_rank,
)
from .model_replica import config_hash

if TYPE_CHECKING:
    import torch

# sglang's runtime context is process-global: every use of one holds sglang_env's lock, as
# sglang_env.activate does for model replicas
_lock = sglang_env._lock


def _engine_of(engine: EngineLayout | str) -> EngineLayout:
    return EngineLayout.parse(engine, command="LoRA pool") if isinstance(engine, str) else engine


class LoRAPoolReplica:
    """sglang's LoRA manager and memory pool of one engine rank, on CPU."""

    def __init__(self, setting: LoRASetting, engine: EngineLayout, rank: int, manager: Any, context: Any):
        self.setting = setting
        self.engine = engine
        self.rank = rank
        self._manager = manager
        self._context = context
        self._loaded: dict[str, Any] = {}  # engine_load's adapters: name -> sglang's LoRARef
        self.layout = self._describe()

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def build(cls, config: Any, setting: LoRASetting, engine: EngineLayout | str, rank: int) -> "LoRAPoolReplica":
        """Build engine rank ``rank``'s pool as an sglang engine of layout ``engine`` started with
        ``setting`` would (``config``: a folder with config.json, the file, or a transformers config)."""
        import torch

        engine = _engine_of(engine)
        sglang_env.prepare()
        from sglang.srt import runtime_context as rc
        from sglang.srt.configs.load_config import LoadConfig
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.lora.lora_manager import LoRAManager
        from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
        from sglang.srt.model_loader.utils import set_default_torch_dtype
        from sglang.srt.server_args import ServerArgs

        sglang_env.import_model_modules(sglang_env.config_dir_of(config))
        with _lock, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                server_args = ServerArgs(model_path=sglang_env.config_dir_of(config), device="cuda",
                                         skip_tokenizer_init=True, **engine.server_args(), **setting.server_args())
                context = sglang_env.rank_context(server_args, rank)
                with rc.use_context(context):
                    model_config = ModelConfig.from_server_args(server_args)
                    load_config = LoadConfig()
                    quant_config = _get_quantization_config(model_config, load_config)
                    with set_default_torch_dtype(model_config.dtype), torch.device("meta"):
                        model = _initialize_model(model_config, load_config, quant_config)
                    # the pool goes where the base model's parameters are; no LoRA code reads them
                    sglang_env.replace_parameters(
                        model, lambda name, old: torch.zeros((), dtype=old.dtype).expand(old.shape))
                    lora = rc.get_lora()
                    manager = LoRAManager(
                        base_model=model,
                        base_hf_config=model_config.hf_config,
                        max_loras_per_batch=lora.max_loras_per_batch,
                        load_config=load_config,
                        dtype=model_config.dtype,
                        server_args=server_args,
                        lora_backend=lora.lora_backend,
                        max_lora_rank=lora.max_lora_rank,
                        target_modules=lora.lora_target_modules,
                    )
            except (UnsupportedLayout, LayoutMismatch):
                raise
            except Exception as e:  # sglang refuses the setting, or cannot build it on this host
                raise UnsupportedLayout(
                    f"sglang cannot build the LoRA pool of engine layout {engine.describe()} rank {rank} with "
                    f"{setting.flags()} here: {type(e).__name__}: {e}") from e
        return cls(setting, engine, rank, manager, context)

    @property
    def _pool(self) -> Any:
        return self._manager.memory_pool

    def _tensors(self) -> list[tuple[AdapterBuffer, "torch.Tensor"]]:
        """Every pool buffer with its tensor: per module (by name), per layer, A then B."""
        pool = self._pool
        extra = [n for n in ("embedding_A_buffer", "lm_head_A_buffer", "new_embeddings_buffer") if getattr(pool, n)]
        if extra:
            raise UnsupportedLayout(f"LoRA pools with embedding or lm_head adapters ({', '.join(extra)}) are not "
                                    f"described yet", hint="leave embed_tokens and lm_head out of --lora-target-modules")
        out = []
        for module in sorted(pool.A_buffer):  # sglang's dict follows a set's order, which varies by process
            for layer in range(len(pool.A_buffer[module])):
                for side, tensors in (("A", pool.A_buffer), ("B", pool.B_buffer)):
                    t = tensors[module][layer]
                    if not t.is_contiguous():
                        raise UnsupportedLayout(f"LoRA pool buffer {side} {module} layer {layer} is not contiguous")
                    desc = AdapterBuffer(name=buffer_name(side, module, layer), module=module, layer=layer, side=side,
                                         shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                                         nbytes=t.numel() * t.element_size())
                    out.append((desc, t))
        return out

    def _describe(self) -> LoRAPoolLayout:
        return LoRAPoolLayout(setting=self.setting, tp_size=self.engine.tp_size, tp_rank=self.rank,
                              pool_modules=tuple(sorted(self._pool.target_modules)),
                              buffers=tuple(b for b, _ in self._tensors()))

    # -- an adapter's bytes --------------------------------------------------------------------
    def check_adapter(self, adapter_config: Mapping[str, Any], tensor_names: Any, name: str) -> None:
        """Refuse (LayoutMismatch, one line naming the adapter, the module and the fix) an adapter
        this pool cannot hold: rank above ``max_lora_rank``, or a module outside the engine's targets."""
        from sglang.srt.lora.utils import get_normalized_target_modules

        modules = adapter_modules(tensor_names)
        declared = adapter_config.get("target_modules") or []
        declared = [declared] if isinstance(declared, str) else list(declared)
        pool_modules = set(self._pool.target_modules)
        for module in modules + [m for m in declared if m not in modules and m != "all-linear"]:
            names = get_normalized_target_modules([module]) or {module}
            normalized = next(iter(names)) if len(names) == 1 else module
            if normalized not in pool_modules and "all" not in names:
                refuse_module(name, module, normalized, self.setting)
        refuse_rank(name, int(adapter_config.get("r", 0)), modules or declared, self.setting)

    def adapter_slot_bytes(self, adapter_config: Mapping[str, Any], tensors: Mapping[str, "torch.Tensor"],
                           slot: int, *, name: str = "adapter") -> dict[str, "torch.Tensor"]:
        """The bytes sglang's own load of this PEFT adapter (``adapter_config.json`` as a dict, and
        ``{peft tensor name: tensor}``) puts into slot ``slot`` of every pool buffer on this rank:
        ``{buffer name: uint8 tensor of the slot region's nbytes}``, in :attr:`layout` order.

        The slot is zeroed first, so the bytes past the adapter's rank (sglang's load leaves the
        previous occupant's there; no kernel reads them) are zero, and so are buffers of modules the
        adapter does not adapt (sglang zeroes those itself)."""
        import torch

        if not 1 <= slot < self.layout.slots:
            raise ValueError(f"adapter slot {slot} is not an adapter slot of a pool of {self.layout.slots} "
                             f"(slot 0 is the base model's)")
        self.check_adapter(adapter_config, tensors.keys(), name)
        from sglang.srt import runtime_context as rc
        from sglang.srt.lora.lora_registry import LoRARef

        manager, pool = self._manager, self._pool
        ref = LoRARef(lora_id=f"p2pw-{uuid.uuid4().hex}", lora_name=f"p2pw-{name}-{uuid.uuid4().hex[:8]}",
                      lora_path=f"<p2pweights:{name}>", pinned=False)
        with _lock, rc.use_context(self._context), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = manager.load_lora_adapter_from_tensors(ref, dict(tensors), dict(adapter_config))
            if not result.success:
                raise LayoutMismatch(f"sglang refused LoRA adapter {name!r}: {result.error_message}",
                                     hint=f"the engine runs {self.setting.flags()}")
            try:
                for _, t in self._tensors():
                    t[slot].zero_()
                pool.load_lora_weight_to_buffer(ref.lora_id, slot, manager.loras[ref.lora_id], manager.lora_modules,
                                                manager.embed_tokens_module, manager.lm_head_module)
                return {desc.name: t[slot].contiguous().view(-1).view(torch.uint8).clone()
                        for desc, t in self._tensors()}
            finally:
                manager.unload_lora_adapter(ref)  # the CPU copy only: the slot was never registered


    # -- the engine's own registry (an engine host running this pool: receiver/adapter_pool.py) ----
    def engine_load(self, name: str, path: str, pinned: bool = True) -> int:
        """sglang's own ``/load_lora_adapter`` of PEFT files, then a batch asking for it
        (``fetch_new_loras``): the slot sglang gave it. A pinned adapter is never evicted, so the slot
        stays its own. Raises LayoutMismatch with sglang's message when sglang refuses it."""
        from sglang.srt import runtime_context as rc
        from sglang.srt.lora.lora_registry import LoRARef

        if name in self._loaded:
            raise LayoutMismatch(f"LoRA adapter {name!r} is already loaded", parameter=name,
                                 hint="unload it first (unload_lora_adapter), or update it in place")
        ref = LoRARef(lora_id=f"p2pw-{uuid.uuid4().hex}", lora_name=name, lora_path=str(path), pinned=bool(pinned))
        with _lock, rc.use_context(self._context), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = self._manager.load_lora_adapter(ref)
            if not result.success:
                raise LayoutMismatch(f"sglang refused LoRA adapter {name!r} from {path}: {result.error_message}",
                                     parameter=name, hint=f"the engine runs {self.setting.flags()}")
            self._manager.fetch_new_loras({ref.lora_id})
        self._loaded[name] = ref
        return self.engine_slot(name)

    def engine_slot(self, name: str) -> int:
        """The slot a loaded adapter occupies (KeyError naming the loaded ones when it is not)."""
        ref = self._loaded.get(name)
        if ref is None:
            raise KeyError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self._loaded) or 'none'})")
        return int(self._pool.uid_to_buffer_id[ref.lora_id])

    def engine_unload(self, name: str) -> None:
        """sglang's own unload; the slot is zeroed (nothing of the adapter stays readable)."""
        from sglang.srt import runtime_context as rc
        from sglang.srt.lora.mem_pool import EMPTY_SLOT

        slot = self.engine_slot(name)
        ref = self._loaded.pop(name)
        with _lock, rc.use_context(self._context):
            self._manager.unload_lora_adapter(ref)
            for _, t in self._tensors():
                t[slot].zero_()
            self._pool.uid_to_buffer_id.pop(ref.lora_id, None)
            self._pool.buffer_id_to_uid[slot] = EMPTY_SLOT

    def rebind(self, view: Any) -> None:
        """Move every pool buffer into memory the caller owns (a registered region): ``view(buffer,
        tensor)`` answers the new tensor of the same shape and dtype; the bytes are copied."""
        pool = self._pool
        for desc, t in self._tensors():
            new = view(desc, t)
            new.copy_(t)
            (pool.A_buffer if desc.side == "A" else pool.B_buffer)[desc.module][desc.layer] = new

    def slot_tensor(self, buffer: str, slot: int) -> "torch.Tensor":
        """Slot ``slot`` of pool buffer ``buffer`` (a view of the pool's memory)."""
        for desc, t in self._tensors():
            if desc.name == buffer:
                return t[slot]
        raise KeyError(self.layout._missing(buffer))


_replicas: dict[tuple, LoRAPoolReplica] = {}


def lora_pool_replica(config: Any, setting: LoRASetting, engine: EngineLayout | str, rank: int) -> LoRAPoolReplica:
    """The process's one :class:`LoRAPoolReplica` of (model config, LoRA setting, layout, rank)."""
    engine = _engine_of(engine)
    key = (config_hash(config), setting, engine, rank)
    with _lock:
        replica = _replicas.get(key)
        if replica is None:
            replica = _replicas[key] = LoRAPoolReplica.build(config, setting, engine, rank)
        return replica
