"""vLLM 0.33's LoRA tensors of one engine rank, built in this process on CPU, and an adapter slot's bytes.

A vLLM engine started with ``--enable-lora`` wraps each target linear layer right after the model
loads (``LoRAModelManager._create_lora_modules``) and allocates, once, one zeroed tensor per slice
and side: ``lora_a_stacked[i]`` of shape ``[max_loras, 1, max_lora_rank, in_local]`` and
``lora_b_stacked[i]`` of shape ``[max_loras, 1, out_i, max_lora_rank]`` in the LoRA dtype (a
packed ``qkv_proj`` has three slices q, k, v; ``gate_up_proj`` two). Slot ``s`` of a tensor is its
row ``s`` along dim 0: one contiguous block. vLLM has no base-model slot (no adapter is index -1).

:class:`VllmLoRAReplica` builds the rank's model as :mod:`.vllm_env` does (on meta, parameters then
one-element CPU stand-ins: no LoRA code reads a base weight) and vLLM's own
``LRUCacheLoRAModelManager`` over it, which wraps the layers and allocates those tensors in real
CPU memory. :meth:`VllmLoRAReplica.adapter_slot_bytes` runs vLLM's own adapter load
(``PEFTHelper`` and its checks, ``LoRAModel.from_lora_tensors``: names, cast to the LoRA dtype;
``add_adapter``: q/k/v and gate/up packing, scaling folded into B; ``activate_adapter``: every
wrapped layer's ``reset_lora`` then ``set_lora`` with its TP slicing) into the requested slot and
reads the slot back. Nothing of the layout is written here by hand; tests/test_vllm_lora.py holds
the bytes equal to an engine-built rank's after the worker's own load of adapter files.

On a host without an accelerator two things of vLLM's need the caller's help (the test does it in
fixtures): the Hopper stand-in makes vLLM pick its GPU punica wrapper (kernel metadata only, no
adapter bytes) and pin host memory for the adapter's CPU copy.

Public API::

    VllmLoRAReplica.build(config, setting, layout, rank)   # one engine rank's LoRA tensors
    replica.layout -> VllmLoRALayout                       # buffers, shapes, slot regions
    replica.adapter_slot_bytes(adapter_config, tensors, slot, name=...) -> {buffer name: uint8 tensor}
    vllm_lora_replica(config, setting, layout, rank)       # the process's one per key (cached)
"""
from __future__ import annotations

import itertools
import re
import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import LayoutMismatch, UnsupportedLayout
from ..models import load_config
from . import vllm_env
from .lora_layout import AdapterBuffer, AdapterBuffers, adapter_modules, refuse_rank
from .model_replica import config_hash
from .sglang_env import replace_parameters
from .vllm_layout import VllmLayout

if TYPE_CHECKING:
    import torch

_lock = threading.RLock()
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# vLLM's LoRA wrappers outside the decoder layers: their slot rows are zeroed by every activation of
# an adapter without embedding or lm_head LoRA; the layout leaves them out (docs/lora.md, "vLLM")
_OUTSIDE_LAYERS = ("VocabParallelEmbeddingWithLoRA", "LogitsProcessorWithLoRA")
# PEFT names of embedding and lm_head adapters, which this replica refuses for now
_EMBEDDING_LORA = re.compile(r"lora_embedding_[AB]|(?:^|\.)(?:embed_tokens|lm_head)\.lora_[AB]")
_adapter_ids = itertools.count(1 << 30)  # vLLM's int ids of the replica's adapters, apart from engines'


@dataclass(frozen=True)
class VllmLoRASetting:
    """The engine args that decide a vLLM engine's LoRA tensors (every rank of it).

    ``target_modules`` as ``--lora-target-modules`` (None: every module vLLM supports, its default;
    vLLM names such as ``qkv_proj`` or adapter names such as ``q_proj``); ``lora_dtype`` as
    ``--lora-dtype`` (``auto``: the model's dtype)."""

    max_lora_rank: int
    max_loras: int = 1
    target_modules: tuple[str, ...] | None = None
    lora_dtype: str = "auto"
    fully_sharded_loras: bool = False

    def __post_init__(self) -> None:
        if self.target_modules is not None:
            object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if int(self.max_lora_rank) < 1 or int(self.max_loras) < 1:
            raise ValueError(f"vLLM LoRA setting needs max_lora_rank >= 1 and max_loras >= 1: {self}")

    def engine_args(self) -> dict[str, Any]:
        """Keyword arguments for vLLM's ``EngineArgs``."""
        return {
            "enable_lora": True,
            "max_lora_rank": int(self.max_lora_rank),
            "max_loras": int(self.max_loras),
            "lora_target_modules": list(self.target_modules) if self.target_modules is not None else None,
            "lora_dtype": self.lora_dtype,
            "fully_sharded_loras": bool(self.fully_sharded_loras),
        }

    def flags(self) -> str:
        """The setting as the engine's command line spells it (for messages)."""
        out = f"--enable-lora --max-lora-rank {self.max_lora_rank} --max-loras {self.max_loras}"
        if self.target_modules is not None:
            out += f" --lora-target-modules {' '.join(self.target_modules)}"
        if self.lora_dtype != "auto":
            out += f" --lora-dtype {self.lora_dtype}"
        return out + (" --fully-sharded-loras" if self.fully_sharded_loras else "")


def buffer_name(side: str, module: str, slice_index: int, layer: int) -> str:
    """``lora.A.qkv_proj.s0.L3``: slice 0 (q) of layer 3's ``qkv_proj`` A tensor."""
    return f"lora.{side}.{module}.s{slice_index}.L{layer}"


@dataclass(frozen=True)
class VllmLoRALayout(AdapterBuffers):
    """vLLM's LoRA tensors on one engine rank: every buffer, in (module name, layer, slice, A before
    B) order. Slots ``0 .. max_loras-1`` all hold adapters (``lora_index_to_id``); none is the
    base model's. ``slice_modules``: which adapter module each slice holds
    (``{"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), ...}``)."""

    setting: VllmLoRASetting
    tp_size: int
    tp_rank: int
    slice_modules: Mapping[str, tuple[str, ...]]
    buffers: tuple[AdapterBuffer, ...]
    dtype: str  # the LoRA dtype vLLM resolved (``auto`` -> the model's)

    @property
    def slots(self) -> int:
        return self.setting.max_loras

    def _missing(self, name: str) -> str:
        return f"no vLLM LoRA buffer {name!r} on rank {self.tp_rank} (modules {sorted(self.slice_modules)})"


def _layout_of(layout: VllmLayout | str) -> VllmLayout:
    return VllmLayout.parse(layout, command="vLLM LoRA replica") if isinstance(layout, str) else layout


def lora_engine_config(config: Any, layout: VllmLayout, setting: VllmLoRASetting) -> Any:
    """vLLM's ``VllmConfig`` of an engine of ``layout`` started with ``setting``: the flags
    :func:`.vllm_env.engine_config` passes plus the LoRA ones, resolved by vLLM (the LoRA dtype)."""
    vllm_env.prepare()
    from vllm.engine.arg_utils import EngineArgs

    directory = vllm_env.config_dir_of(config)
    max_len = min(256, int(load_config(directory).get("max_position_embeddings") or 256))
    args = EngineArgs(model=directory, skip_tokenizer_init=True, load_format="dummy", enforce_eager=True,
                      max_model_len=max_len, max_cpu_loras=setting.max_loras, **layout.engine_args(),
                      **setting.engine_args())
    try:
        return args.create_engine_config()
    except Exception as e:  # vLLM refuses the LoRA flags for this model
        raise UnsupportedLayout(f"vLLM refuses {setting.flags()} on engine layout {layout.describe()}: "
                                f"{type(e).__name__}: {e}") from e


def lora_tensors(manager: Any) -> list[tuple[AdapterBuffer, "torch.Tensor"]]:
    """Every LoRA tensor of the decoder layers that vLLM's LoRA model manager ``manager`` wraps, with
    its description (:func:`buffer_name`), in layout order: the replica's and an engine worker's
    (vllm_backend/rank_lora.py) one naming."""
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    found: dict[tuple[str, int], str] = {}
    out = []
    for full in sorted(manager.modules, key=_sort_key):
        module = manager.modules[full]
        if type(module).__name__ in _OUTSIDE_LAYERS:
            continue
        if not isinstance(module, BaseLinearLayerWithLoRA):
            raise UnsupportedLayout(f"vLLM's LoRA wrapper {type(module).__name__} of {full} is not described yet "
                                    f"(MoE and classifier LoRA)", hint="leave it out of --lora-target-modules")
        short, layer = full.rsplit(".", 1)[-1], _layer_of(full)
        if found.setdefault((short, layer), full) != full:
            raise UnsupportedLayout(f"vLLM LoRA modules {found[(short, layer)]} and {full} would share the "
                                    f"buffer names of {short} layer {layer}")
        for i in range(module.n_slices):
            for side, stacked in (("A", module.lora_a_stacked), ("B", module.lora_b_stacked)):
                t = stacked[i]
                if not t.is_contiguous():
                    raise UnsupportedLayout(f"vLLM LoRA tensor {side} {full} slice {i} is not contiguous")
                desc = AdapterBuffer(name=buffer_name(side, short, i, layer), module=short, layer=layer,
                                     side=side, shape=tuple(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                                     nbytes=t.numel() * t.element_size())
                out.append((desc, t))
    return out


def _layer_of(full: str) -> int:
    m = _LAYER.search(full)
    if m is None:
        raise UnsupportedLayout(f"vLLM LoRA module {full} is outside the decoder layers: not described yet")
    return int(m.group(1))


def _sort_key(full: str) -> tuple:
    m = _LAYER.search(full)
    return (full.rsplit(".", 1)[-1], int(m.group(1)) if m else -1, full)


class VllmLoRAReplica:
    """vLLM's LoRA model manager and LoRA tensors of one engine rank, on CPU."""

    def __init__(self, setting: VllmLoRASetting, layout: VllmLayout, rank: int, model: Any, manager: Any,
                 vllm_config: Any):
        self.setting = setting
        self.engine = layout
        self.rank = rank
        self._model = model
        self._manager = manager
        self._vllm_config = vllm_config
        self.layout = self._describe()

    # -- building ------------------------------------------------------------------------------
    @classmethod
    def build(cls, config: Any, setting: VllmLoRASetting, layout: VllmLayout | str, rank: int) -> "VllmLoRAReplica":
        """Build engine rank ``rank``'s LoRA tensors as a vLLM engine of ``layout`` started with
        ``setting`` would (``config``: a folder with config.json, the file, or a transformers config).

        The base model is :func:`.vllm_env.build_model`'s (vLLM 0.33's decoder models read no
        LoRA setting while building); the manager gets the LoRA-enabled ``VllmConfig``."""
        import torch

        layout = _layout_of(layout)
        vllm_config = lora_engine_config(config, layout, setting)
        model = vllm_env.build_model(config, layout, rank, device="meta")
        # the LoRA tensors go where the base layers' weights are; no LoRA code reads them
        replace_parameters(model, lambda name, old: torch.zeros((), dtype=old.dtype).expand(old.shape))
        from vllm.config import set_current_vllm_config
        from vllm.lora.model_manager import LRUCacheLoRAModelManager, create_lora_manager

        with _lock, vllm_env.activate(model), set_current_vllm_config(vllm_config), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                manager = create_lora_manager(
                    model,
                    max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
                    max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
                    vocab_size=vllm_config.model_config.get_vocab_size(),
                    lora_config=vllm_config.lora_config,
                    vllm_config=vllm_config,
                    device=torch.device("cpu"),
                    lora_manager_cls=LRUCacheLoRAModelManager,
                )
            except (UnsupportedLayout, LayoutMismatch):
                raise
            except Exception as e:  # vLLM cannot wrap this model, or cannot on this host
                raise UnsupportedLayout(
                    f"vLLM cannot build the LoRA tensors of engine layout {layout.describe()} rank {rank} with "
                    f"{setting.flags()} here: {type(e).__name__}: {e}") from e
        return cls(setting, layout, rank, model, manager, vllm_config)

    def _tensors(self) -> list[tuple[AdapterBuffer, "torch.Tensor"]]:
        """Every LoRA tensor of the decoder layers with its description, in layout order."""
        return lora_tensors(self._manager)

    def _slice_modules(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, tuple[str, ...]] = {}
        for full, module in self._manager.modules.items():
            if type(module).__name__ in _OUTSIDE_LAYERS:
                continue
            short = full.rsplit(".", 1)[-1]
            subs = self._manager.packed_modules.get(full) or [short]  # vLLM keeps them by full name
            out[short] = tuple(sub.rsplit(".", 1)[-1] for sub in subs)
        return dict(sorted(out.items()))

    def _describe(self) -> VllmLoRALayout:
        return VllmLoRALayout(setting=self.setting, tp_size=self.engine.tp, tp_rank=self.rank,
                              slice_modules=self._slice_modules(), buffers=tuple(b for b, _ in self._tensors()),
                              dtype=str(self._manager.lora_config.lora_dtype).removeprefix("torch."))

    # -- an adapter's bytes --------------------------------------------------------------------
    def check_adapter(self, adapter_config: Mapping[str, Any], tensors: Mapping[str, Any], name: str) -> None:
        """Refuse an adapter this engine's LoRA tensors cannot hold, in one line naming the adapter,
        the module and the fix: rank above ``--max-lora-rank`` (LayoutMismatch), a module the engine
        has no LoRA tensors for (LayoutMismatch), embedding or lm_head LoRA (UnsupportedLayout)."""
        embedding = [n for n in tensors if _EMBEDDING_LORA.search(n)]
        if embedding:
            raise UnsupportedLayout(f"LoRA adapter {name!r} adapts the embedding or lm_head ({embedding[0]}): the "
                                    f"vLLM LoRA replica describes decoder-layer linears only",
                                    parameter=embedding[0], hint="train the adapter without embed_tokens and lm_head")
        modules = adapter_modules(tensors)
        held = {sub for subs in self.layout.slice_modules.values() for sub in subs}
        for module in modules:
            if module not in held:
                raise LayoutMismatch(
                    f"LoRA adapter {name!r} adapts module {module} but the vLLM engine holds LoRA tensors for "
                    f"{' '.join(sorted(held))} only ({self.setting.flags()}): vLLM would leave {module} out",
                    parameter=module,
                    hint=f"restart the engine with {module} in --lora-target-modules (or without that flag), or "
                         f"train the adapter without {module}")
        ranks = {_module_of(n): int(t.shape[0]) for n, t in tensors.items() if ".lora_A." in n and t.dim() == 2}
        declared = [int(adapter_config.get("r", 0)), *map(int, (adapter_config.get("rank_pattern") or {}).values())]
        r = max([*ranks.values(), *declared])
        refuse_rank(name, r, [m for m in modules if ranks.get(m, r) > self.setting.max_lora_rank] or modules,
                    self.setting)

    def adapter_slot_bytes(self, adapter_config: Mapping[str, Any], tensors: Mapping[str, "torch.Tensor"],
                           slot: int, *, name: str = "adapter") -> dict[str, "torch.Tensor"]:
        """The bytes vLLM's own load of this PEFT adapter (``adapter_config.json`` as a dict, and
        ``{peft tensor name: tensor}``) puts into slot ``slot`` of every LoRA tensor on this rank:
        ``{buffer name: uint8 tensor of the slot region's nbytes}``, in :attr:`layout` order.

        vLLM zeroes the whole slot before writing it, so these are every byte of the slot,
        padding past the adapter's rank and slices the adapter lacks (zeros) included."""
        import torch

        if not 0 <= slot < self.layout.slots:
            raise ValueError(f"adapter slot {slot} is not a slot of vLLM's {self.layout.slots} (--max-loras)")
        self.check_adapter(adapter_config, tensors, name)
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager, model, vllm_config = self._manager, self._model, self._vllm_config
        text_config = vllm_config.model_config.hf_config.get_text_config()
        peft = dict(adapter_config, vllm_max_position_embeddings=getattr(text_config, "max_position_embeddings", None))
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        with _lock, vllm_env.activate(model), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                helper = PEFTHelper.from_dict(peft)
                helper.validate_legal(manager.lora_config)
            except ValueError as e:
                raise LayoutMismatch(f"vLLM refuses LoRA adapter {name!r}: {e}",
                                     hint=f"the engine runs {self.setting.flags()}") from e
            # copies: vLLM folds the scaling into B in place, into the caller's tensor when its cast is a no-op
            own = {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()}
            lora = LoRAModel.from_lora_tensors(
                lora_model_id=next(_adapter_ids), tensors=own, peft_helper=helper, device="cpu",
                dtype=manager.lora_config.lora_dtype, model_vocab_size=vllm_config.model_config.get_vocab_size(),
                weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
                skip_prefixes=getattr(model, "lora_skip_prefixes", None))
            lora.is_3d_lora_weight = False  # as a LoRARequest's default
            if manager._active_adapters or any(i is not None for i in manager.lora_index_to_id):
                raise RuntimeError("the vLLM LoRA replica's manager holds an active adapter")  # never: see finally
            try:
                manager.add_adapter(lora)  # vLLM packs q/k/v and gate/up and folds the scaling into B
                # vLLM activates into its first free slot: make ``slot`` the only free one
                manager.lora_index_to_id[:] = [None if i == slot else -1 for i in range(self.layout.slots)]
                try:
                    manager.activate_adapter(lora.id)
                except (RuntimeError, ValueError) as e:  # a tensor whose shape is not the model's
                    raise LayoutMismatch(f"vLLM cannot put LoRA adapter {name!r} into slot {slot}: "
                                         f"{type(e).__name__}: {e}".replace("\n", " "),
                                         hint="the adapter must be trained on this model") from e
                if manager.lora_index_to_id[slot] != lora.id:
                    raise RuntimeError(f"vLLM activated the adapter into slot "
                                       f"{manager.lora_index_to_id.index(lora.id)}, not {slot}")
                return {desc.name: t[slot].contiguous().view(-1).view(torch.uint8).clone()
                        for desc, t in self._tensors()}
            finally:
                manager.remove_adapter(lora.id)
                manager.lora_index_to_id[:] = [None] * self.layout.slots


def _module_of(tensor_name: str) -> str:
    return adapter_modules([tensor_name])[0]


_replicas: dict[tuple, VllmLoRAReplica] = {}


def vllm_lora_replica(config: Any, setting: VllmLoRASetting, layout: VllmLayout | str, rank: int) -> VllmLoRAReplica:
    """The process's one :class:`VllmLoRAReplica` of (model config, LoRA setting, layout, rank)."""
    layout = _layout_of(layout)
    key = (config_hash(config), setting, layout, rank)
    with _lock:
        replica = _replicas.get(key)
        if replica is None:
            replica = _replicas[key] = VllmLoRAReplica.build(config, setting, layout, rank)
        return replica

