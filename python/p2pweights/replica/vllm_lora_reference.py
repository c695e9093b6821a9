"""vLLM 0.33's own adapter load on one engine rank, the reference ``check-layout --engine-kind vllm --lora`` holds the replica to.

The "engine" here is vLLM's own code as an engine rank's worker runs it
(``LoRAModelRunnerMixin.load_lora_model`` then ``add_lora``): the rank's model built for real on
CPU under a LoRA-enabled ``VllmConfig`` made by vLLM's ``EngineArgs`` from the engine's flags,
``LRUCacheWorkerLoRAManager.create_lora_manager`` over it, adapters loaded from PEFT files by
``add_adapter(LoRARequest)`` (which activates each into vLLM's first free slot, evicting the least
recently used one when all are taken). Nothing of the replica (replica/vllm_lora.py) is used: the
LoRA tensors are read by vLLM's module names. tests/test_vllm_lora.py and the command both use it.

Public API::

    vllm_lora_on_cpu()                                       # context manager: this check only
    engine_worker(config_dir, setting, layout, rank) -> (model, worker)
    engine_adds(model, worker, name, lora_int_id, path) -> slot
    engine_tensor(worker, buffer) -> the LoRA tensor behind an AdapterBuffer
    engine_buffers(worker) -> {buffer name: (shape, dtype, nbytes)} of every decoder-layer LoRA tensor
"""
from __future__ import annotations

import contextlib
import os
import re
from typing import TYPE_CHECKING, Any, Iterator

from ..models import load_config
from . import vllm_env
from .lora_layout import AdapterBuffer
from .vllm_layout import VllmLayout
from .vllm_lora import VllmLoRASetting, buffer_name

if TYPE_CHECKING:
    import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@contextlib.contextmanager
def vllm_lora_on_cpu() -> Iterator[None]:
    """Two stand-ins for a host without an accelerator, for this check (and its test) only; the
    library never applies them globally, and neither changes a byte of an adapter slot:

    - the Hopper stand-in platform makes vLLM's LoRA manager pick ``PunicaWrapperGPU``, whose
      metadata needs Triton's GPU driver; ``PunicaWrapperCPU`` stands in. The punica wrapper holds
      kernel metadata (token-to-slot mappings), never an adapter byte;
    - the stand-in also says pinned host memory exists, so ``LoRAModel.from_lora_tensors`` calls
      ``.pin_memory()`` on the adapter's CPU copy, which torch refuses without an accelerator.
      Pinning only speeds up host-to-device copies; here it is the identity."""
    import torch

    vllm_env.prepare()
    import vllm.lora.model_manager as model_manager
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    original_wrapper, original_pin = model_manager.get_punica_wrapper, torch.Tensor.pin_memory
    model_manager.get_punica_wrapper = lambda *a, **k: PunicaWrapperCPU(*a, **k)
    if not torch.cuda.is_available():
        torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        model_manager.get_punica_wrapper = original_wrapper
        torch.Tensor.pin_memory = original_pin  # type: ignore[method-assign]


@contextlib.contextmanager
def _engine_config_held(config_dir: str, layout: VllmLayout, vllm_config: Any) -> Iterator[None]:
    """vllm_env builds a rank under the VllmConfig it holds for (config folder, layout): the
    engine's, while the engine's rank is built; the one held before is put back afterwards."""
    key = (os.path.abspath(config_dir), layout)
    missing = object()
    before = vllm_env._configs.get(key, missing)
    vllm_env._configs[key] = vllm_config
    try:
        yield
    finally:
        if before is missing:
            vllm_env._configs.pop(key, None)
        else:
            vllm_env._configs[key] = before


def engine_worker(config_dir: str, setting: VllmLoRASetting, layout: VllmLayout, rank: int, *,
                  max_cpu_loras: int | None = None) -> tuple["torch.nn.Module", Any]:
    """vLLM's own worker-side LoRA manager of engine rank ``rank``: the rank's model built for real on
    CPU under the engine's LoRA-enabled VllmConfig, then ``create_lora_manager`` over it."""
    import torch

    vllm_env.prepare()
    from vllm.engine.arg_utils import EngineArgs
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    max_len = min(256, int(load_config(config_dir).get("max_position_embeddings") or 256))
    lora_flags = {"enable_lora": True, "max_lora_rank": setting.max_lora_rank, "max_loras": setting.max_loras,
                  "max_cpu_loras": max_cpu_loras or max(4, setting.max_loras), "lora_dtype": setting.lora_dtype,
                  "fully_sharded_loras": setting.fully_sharded_loras,
                  "lora_target_modules": list(setting.target_modules) if setting.target_modules is not None else None}
    args = EngineArgs(model=config_dir, skip_tokenizer_init=True, load_format="dummy", enforce_eager=True,
                      max_model_len=max_len, **layout.engine_args(), **lora_flags)
    vllm_config = args.create_engine_config()
    with _engine_config_held(config_dir, layout, vllm_config):
        model = vllm_env.build_model(config_dir, layout, rank, device="cpu")
    with vllm_env.activate(model):
        worker = LRUCacheWorkerLoRAManager(vllm_config, torch.device("cpu"), model.embedding_modules)
        worker.create_lora_manager(model, vllm_config)
    return model, worker


def engine_adds(model: "torch.nn.Module", worker: Any, name: str, lora_int_id: int, path: str) -> int:
    """The engine's own ``add_lora`` of adapter files: the slot vLLM activated it into. Raises
    RuntimeError when vLLM's load fails."""
    from vllm.lora.request import LoRARequest

    with vllm_env.activate(model):
        if not worker.add_adapter(LoRARequest(name, lora_int_id, path)):
            raise RuntimeError(f"vLLM's add_adapter of {path} (id {lora_int_id}) added nothing")
    return worker._adapter_manager.lora_index_to_id.index(lora_int_id)


def _linear_modules(worker: Any) -> dict[tuple[str, int], Any]:
    """The engine's decoder-layer LoRA linears by (vLLM's module name, layer)."""
    out = {}
    for full, module in worker._adapter_manager.modules.items():
        m = _LAYER.search(full)
        if m is not None and hasattr(module, "n_slices"):
            out[(full.rsplit(".", 1)[-1], int(m.group(1)))] = module
    return out


def engine_tensor(worker: Any, buffer: AdapterBuffer) -> "torch.Tensor":
    """The engine's tensor behind a replica buffer, found by vLLM's module name and layer."""
    module = _linear_modules(worker)[(buffer.module, buffer.layer)]
    stacked = module.lora_a_stacked if buffer.side == "A" else module.lora_b_stacked
    return stacked[int(buffer.name.split(".")[3].removeprefix("s"))]


def engine_buffers(worker: Any) -> dict[str, tuple[tuple[int, ...], str, int]]:
    """Every LoRA tensor of the engine's decoder layers: ``{buffer name: (shape, dtype, nbytes)}``."""
    return {buffer_name(side, short, i, layer): (tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                                 t.numel() * t.element_size())
            for (short, layer), module in _linear_modules(worker).items() for i in range(module.n_slices)
            for side, t in (("A", module.lora_a_stacked[i]), ("B", module.lora_b_stacked[i]))}
