"""An out-of-tree sglang platform for hosts without CUDA, so that a real ``python -m
sglang.launch_server --device cpu`` runs there (tests, the demo): sglang's own CPU engine
(``SGLANG_USE_CPU_ENGINE=1``) needs sgl-kernel's CPU ops, which no registry build provides, and
without any platform ``--device cpu`` reaches a vLLM import (docs/sglang.md).

The platform is sglang's own ``CpuSRTPlatform`` declared out-of-tree (``PlatformEnum.OOT``), so
sglang takes its torch-native paths instead of the in-tree CPU kernels. It is registered under
``sglang.srt.platforms`` as ``p2pw_cpu`` and is chosen only when asked for by name:
``SGLANG_PLATFORM=p2pw_cpu``. :func:`activate` answers None otherwise, and always on a host where
torch sees CUDA (or ROCm), so sglang's auto-discovery (which calls every platform plugin's
``activate`` and, with none active, falls back to its own CUDA/ROCm/... detection) is unchanged on
GPU hosts and on every CPU host that does not ask for it. Not active by default on CPU hosts either:
an out-of-tree platform changes what sglang resolves in any process that imports it, the sender's
replicas included (they are built as a GPU rank's model; docs/sglang.md).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from typing import Any, Iterator

import torch
from sglang.srt.platforms.cpu import CpuSRTPlatform
from sglang.srt.platforms.device_mixin import PlatformEnum

from ..replica.sglang_imports import StubFinder

NAME = "p2pw_cpu"  # the entry-point name, what SGLANG_PLATFORM must say
KV_COPY_TARGET = "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup"
LM_HEAD_TARGET = "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.init_lm_head"
DRAFT_EXTEND_TARGET = "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_draft_extend_backend"
LORA_INIT_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.init_lora_manager"
LORA_BATCH_TARGET = "sglang.srt.lora.lora_manager.LoRAManager.prepare_lora_batch"


class CpuHostPlatform(CpuSRTPlatform):
    """sglang's CPU platform, out of tree: torch-native attention unless told otherwise."""

    _enum = PlatformEnum.OOT

    def get_default_attention_backend(self) -> str:
        # an OOT platform must name one (sglang raises otherwise); the one that needs no kernels
        return "torch_native"

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        # a drafting server must start and load both roles here (the plugin's per-role publications);
        # its drafting kernels are never run on this platform
        return algorithm in ("EAGLE", "NEXTN")

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return backend == "torch_native"


def activate() -> str | None:
    """sglang's platform entry point: this class's qualified name when selected, else None."""
    if os.environ.get("SGLANG_PLATFORM", "") != NAME or torch.cuda.is_available():
        return None
    _stub_torchvision_if_missing()
    # a drafting server's KV pool moves cache slots; its tiled copy is a Triton kernel, which needs a
    # GPU driver: the native move instead (sglang reads this when it builds the pool)
    os.environ.setdefault("SGLANG_NATIVE_MOVE_KV_CACHE", "1")
    return f"{CpuHostPlatform.__module__}.{CpuHostPlatform.__qualname__}"


def _stub_torchvision_if_missing() -> None:
    """sglang imports torchvision at module level (multimodal processors) that a text model never
    calls; the registry's torchvision is a CUDA build. With none installed, imports of it get a stub
    (as the replica does, replica/sglang_env.py)."""
    try:
        found = importlib.util.find_spec("torchvision") is not None
    except (ImportError, ValueError):
        found = False
    if not found and not any(isinstance(f, StubFinder) and "torchvision" in f.packages for f in sys.meta_path):
        sys.meta_path.insert(0, StubFinder(("torchvision",)))


def around_kv_copy_warmup(original, pool, *args, **kwargs):
    """AROUND ``MHATokenToKVPool._init_kv_copy_and_warmup`` (registered in the schedulers of a server on
    this platform): a pool that moves its slots natively (``SGLANG_NATIVE_MOVE_KV_CACHE``, set by
    :func:`activate`) never runs the tiled copy, so neither its config nor its Triton warm-up (no
    driver here: "0 active drivers"); any other pool is sglang's."""
    if getattr(pool, "use_native_move_kv_cache", False):
        pool._kv_copy_config = None
        return None
    return original(pool, *args, **kwargs)


def around_init_lm_head(original, worker, *args, **kwargs):
    """AROUND ``EagleDraftWorker.init_lm_head`` (the schedulers of a server on this platform): the
    draft's ``set_embed_and_head`` ends with ``torch.cuda.synchronize()``, which a torch without CUDA
    refuses; here it has nothing to wait for, so it is a no-op while the draft takes the target's
    embedding and head (as the sender's replica does, replica/draft_model.py)."""
    if torch.cuda.is_available():
        return original(worker, *args, **kwargs)
    empty_cache, synchronize = torch.cuda.empty_cache, torch.cuda.synchronize
    torch.cuda.empty_cache = lambda: None
    torch.cuda.synchronize = lambda *a, **k: None
    try:
        return original(worker, *args, **kwargs)
    finally:
        torch.cuda.empty_cache, torch.cuda.synchronize = empty_cache, synchronize


def around_draft_extend_backend(original, factory, *args, **kwargs):
    """AROUND ``DraftBackendFactory.create_draft_extend_backend`` (the schedulers of a server on this
    platform): sglang has no draft-extend backend for ``torch_native``; None keeps the draft runner's
    own (torch-native) backend, so a drafting server starts and holds both roles' weights. Its
    drafting itself is never run on this platform (servers here skip the warm-up generate)."""
    try:
        return original(factory, *args, **kwargs)
    except ValueError as e:
        if "torch_native" not in str(e):
            raise
        return None


_PINNING_FACTORIES = ("tensor", "zeros", "empty", "ones", "arange", "full")


@contextlib.contextmanager
def unpinned() -> Iterator[None]:
    """While it runs, torch's factories ignore ``pin_memory=True`` and ``Tensor.pin_memory()`` is the
    identity (as ``replica.lora_reference.sglang_lora_on_cpu`` does for the LoRA replica's tests)."""
    saved = {name: getattr(torch, name) for name in _PINNING_FACTORIES}
    pin = torch.Tensor.pin_memory

    def unpinned_factory(factory: Any) -> Any:
        def make(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)
        return make

    for name, factory in saved.items():
        setattr(torch, name, unpinned_factory(factory))
    torch.Tensor.pin_memory = lambda self, *a, **k: self  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, factory in saved.items():
            setattr(torch, name, factory)
        torch.Tensor.pin_memory = pin  # type: ignore[method-assign]


def around_lora_pinning(original, owner, *args, **kwargs):
    """AROUND ``ModelRunner.init_lora_manager`` and ``LoRAManager.prepare_lora_batch`` (the schedulers of
    a server on this platform started with ``--enable-lora``): sglang's LoRA layers and its torch-native
    LoRA backend ask for pinned host tensors, which torch refuses without an accelerator (``pin_memory=True
    requires a CUDA or other accelerator backend``). Pinning only speeds up copies to a device and never
    changes a byte, so it is dropped while these two calls run (:func:`unpinned`), never globally."""
    if torch.cuda.is_available():
        return original(owner, *args, **kwargs)
    with unpinned():
        return original(owner, *args, **kwargs)


def register_scheduler_hooks() -> None:
    """The hooks a drafting or LoRA server needs on this platform, in each scheduler."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(KV_COPY_TARGET, around_kv_copy_warmup, HookType.AROUND)
    HookRegistry.register(LM_HEAD_TARGET, around_init_lm_head, HookType.AROUND)
    HookRegistry.register(DRAFT_EXTEND_TARGET, around_draft_extend_backend, HookType.AROUND)
    HookRegistry.register(LORA_INIT_TARGET, around_lora_pinning, HookType.AROUND)
    HookRegistry.register(LORA_BATCH_TARGET, around_lora_pinning, HookType.AROUND)
