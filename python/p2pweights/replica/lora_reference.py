"""sglang's own adapter load on one engine rank, the reference ``check-layout --lora`` holds the replica to.

The "engine" here is sglang 0.5.23's own code as an engine rank runs it
(``ModelRunner.maybe_init_lora_manager``): the rank's model built for real on CPU,
``LoRAManager`` over it, an adapter loaded from PEFT files by ``load_lora_adapter`` (what
``/load_lora_adapter`` runs) and placed in a slot by ``fetch_new_loras`` (what a batch asking for
it runs). Nothing of the replica (replica/lora_pool.py) is used: the pool's tensors are read by
sglang's module and layer names. tests/test_lora_layout.py and ``check-layout --lora`` both use it.

It also makes random PEFT adapters of any supported model (:func:`random_peft_adapter`, names and
shapes from the model's checkpoint schema) and writes them as files (:func:`write_peft_adapter`),
for both engines.

Public API::

    random_peft_adapter(config, r=4, targets=DENSE_TARGETS, seed=0) -> (adapter_config, {peft name: tensor})
    write_peft_adapter(directory, adapter_config, tensors) -> directory
    sglang_lora_on_cpu()                                    # context manager: pinning dropped, this check only
    engine_lora_manager(config_dir, setting, engine, rank) -> (manager, runtime context)
    engine_loads(manager, context, name, path) -> slot      # load_lora_adapter + fetch_new_loras
    engine_buffer(manager, buffer) -> the pool tensor behind an AdapterBuffer
    engine_buffers(manager) -> {buffer name: (shape, dtype, nbytes)} of every pool tensor
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from typing import TYPE_CHECKING, Any, Iterator

from ..errors import UnsupportedLayout
from ..models import load_config
from ..models.checkpoint import trainer_tensors
from ..models.engine_layout import EngineLayout
from . import sglang_env
from .lora_layout import DENSE_TARGETS, AdapterBuffer, LoRASetting, buffer_name

if TYPE_CHECKING:
    import torch

_LAYER_LINEAR = re.compile(r"^(?P<prefix>(?:.*\.)?layers\.(?P<layer>\d+)\..*\.(?P<module>[a-z_]+))\.weight$")


# -- a random PEFT adapter of the model ------------------------------------------------------------
def random_peft_adapter(config: Any, *, r: int, targets: tuple[str, ...] = DENSE_TARGETS, seed: int = 0,
                        alpha: float | None = None, dtype: "torch.dtype | None" = None,
                        **extra: Any) -> tuple[dict[str, Any], dict[str, "torch.Tensor"]]:
    """A random PEFT LoRA adapter of rank ``r`` over ``targets`` (HF module names) of every decoder
    layer of ``config``: ``(adapter_config.json as a dict, {peft tensor name: tensor})``. Each
    adapted linear ``...layers.N.<parent>.<module>.weight`` of shape ``[out, in]`` gets
    ``lora_A.weight [r, in]`` and ``lora_B.weight [out, r]``, seeded; ``dtype``: the model's by default.

    Refused (:class:`UnsupportedLayout`): a target no layer has, and a target inside MoE experts
    (not built yet, docs/lora.md)."""
    import torch

    cfg = load_config(config)
    specs = trainer_tensors(cfg)
    dtype = dtype or getattr(torch, str(cfg.get("torch_dtype") or "bfloat16").removeprefix("torch."))
    found: dict[str, list[tuple[int, str, tuple[int, ...]]]] = {t: [] for t in targets}
    for name, spec in specs.items():
        m = _LAYER_LINEAR.match(name)
        if m and m.group("module") in found and len(spec.shape) == 2:
            found[m.group("module")].append((int(m.group("layer")), m.group("prefix"), spec.shape))
    for target, sites in found.items():
        experts = [p for _, p, _ in sites if ".experts." in p or "shared_expert" in p]
        if experts:
            raise UnsupportedLayout(f"LoRA on MoE experts is not built yet: target {target} is in {experts[0]}",
                                    parameter=target, hint="pick attention targets only (--lora R,q,k,v,o)")
        if not sites:
            raise UnsupportedLayout(f"the model has no decoder-layer linear {target} to adapt", parameter=target,
                                    hint=f"pick targets among {', '.join(DENSE_TARGETS)}")
    g = torch.Generator().manual_seed(int(seed))
    tensors: dict[str, torch.Tensor] = {}
    order = sorted((layer, i, prefix, shape) for i, target in enumerate(targets) for layer, prefix, shape in found[target])
    for _, _, prefix, (fan_out, fan_in) in order:  # layer by layer, each in the targets' order
        tensors[f"base_model.model.{prefix}.lora_A.weight"] = torch.randn(r, fan_in, generator=g).to(dtype)
        tensors[f"base_model.model.{prefix}.lora_B.weight"] = torch.randn(fan_out, r, generator=g).to(dtype)
    adapter_config = {"peft_type": "LORA", "r": int(r), "lora_alpha": alpha if alpha is not None else 2 * int(r),
                      "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM",
                      "use_rslora": False, "use_dora": False, "base_model_name_or_path": "p2pweights-random", **extra}
    return adapter_config, tensors


def write_peft_adapter(directory: str, adapter_config: dict[str, Any], tensors: dict[str, "torch.Tensor"]) -> str:
    """The adapter as PEFT writes it: ``adapter_model.safetensors`` and ``adapter_config.json``."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    save_file({n: t.contiguous() for n, t in tensors.items()}, os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(adapter_config, f)
    return directory


# -- sglang on a host without an accelerator -------------------------------------------------------
@contextlib.contextmanager
def sglang_lora_on_cpu() -> Iterator[None]:
    """sglang's LoRA layers allocate pinned host tensors (``torch.tensor(..., pin_memory=True)`` and
    ``.pin_memory()`` in sglang/srt/lora/layers.py), which torch refuses without an accelerator.
    Pinning only speeds up host-to-device copies and never changes a byte, so while this check (or
    its test) runs on such a host, it is dropped. Never applied globally: the library leaves torch
    alone, and on a host with an accelerator this does nothing."""
    import torch

    if torch.cuda.is_available():
        yield
        return
    original_tensor, original_pin = torch.tensor, torch.Tensor.pin_memory

    def tensor(*args: Any, **kwargs: Any) -> "torch.Tensor":
        kwargs.pop("pin_memory", None)
        return original_tensor(*args, **kwargs)

    torch.tensor = tensor  # type: ignore[assignment]
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.tensor = original_tensor  # type: ignore[assignment]
        torch.Tensor.pin_memory = original_pin  # type: ignore[method-assign]


# -- the engine rank -------------------------------------------------------------------------------
def engine_lora_manager(config_dir: str, setting: LoRASetting, engine: EngineLayout | str, rank: int) -> tuple[Any, Any]:
    """sglang's own LoRA manager of engine rank ``rank``, as ``ModelRunner`` builds it: the rank's
    model built for real on CPU (``_initialize_model`` under the rank's runtime context), then
    ``LoRAManager`` over it. Returns ``(manager, runtime context)``."""
    import torch

    engine = EngineLayout.parse(engine, command="LoRA reference") if isinstance(engine, str) else engine
    sglang_env.prepare()
    from sglang.srt import runtime_context as rc
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.server_args import ServerArgs

    sglang_env.import_model_modules(config_dir)
    server_args = ServerArgs(model_path=config_dir, device="cuda", skip_tokenizer_init=True, **engine.server_args(),
                             **setting.server_args())
    context = sglang_env.rank_context(server_args, rank)
    with sglang_env._lock, rc.use_context(context):
        model_config = ModelConfig.from_server_args(server_args)
        load_config = LoadConfig(load_format=server_args.load_format)
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            model = _initialize_model(model_config, load_config, _get_quantization_config(model_config, load_config))
        lora = rc.get_lora()
        manager = LoRAManager(base_model=model, base_hf_config=model_config.hf_config,
                              max_loras_per_batch=lora.max_loras_per_batch, load_config=load_config,
                              dtype=model_config.dtype, server_args=server_args, lora_backend=lora.lora_backend,
                              max_lora_rank=lora.max_lora_rank, target_modules=lora.lora_target_modules,
                              lora_paths=lora.lora_paths)
    return manager, context


def engine_loads(manager: Any, context: Any, name: str, path: str) -> int:
    """The engine's own load of adapter files (``/load_lora_adapter``), then a batch asking for it
    (``fetch_new_loras``, what ``ForwardBatch.init_new`` does): the slot sglang gave it. Raises
    RuntimeError with sglang's message when sglang's load fails."""
    from sglang.srt import runtime_context as rc
    from sglang.srt.lora.lora_registry import LoRARef

    ref = LoRARef(lora_id=f"id-{name}", lora_name=name, lora_path=path, pinned=False)
    with sglang_env._lock, rc.use_context(context):
        result = manager.load_lora_adapter(ref)
        if not result.success:
            raise RuntimeError(f"sglang's load_lora_adapter of {path} failed: {result.error_message}")
        manager.fetch_new_loras({ref.lora_id})
    return manager.memory_pool.uid_to_buffer_id[ref.lora_id]


def engine_buffer(manager: Any, buffer: AdapterBuffer) -> "torch.Tensor":
    """The engine pool's tensor behind a replica buffer, found by sglang's module and layer."""
    pool = manager.memory_pool
    side = pool.A_buffer if buffer.side == "A" else pool.B_buffer
    return side[buffer.module][buffer.layer]


def engine_buffers(manager: Any) -> dict[str, tuple[tuple[int, ...], str, int]]:
    """Every tensor of the engine's pool: ``{buffer name: (shape, dtype, nbytes)}``."""
    pool = manager.memory_pool
    return {buffer_name(side, module, layer): (tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                               t.numel() * t.element_size())
            for side, tensors in (("A", pool.A_buffer), ("B", pool.B_buffer))
            for module, layers in tensors.items() for layer, t in enumerate(layers)}
