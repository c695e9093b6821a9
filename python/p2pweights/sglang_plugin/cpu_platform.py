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

import importlib.util
import os
import sys

import torch
from sglang.srt.platforms.cpu import CpuSRTPlatform
from sglang.srt.platforms.device_mixin import PlatformEnum

from ..replica.sglang_imports import StubFinder

NAME = "p2pw_cpu"  # the entry-point name, what SGLANG_PLATFORM must say


class CpuHostPlatform(CpuSRTPlatform):
    """sglang's CPU platform, out of tree: torch-native attention unless told otherwise."""

    _enum = PlatformEnum.OOT

    def get_default_attention_backend(self) -> str:
        # an OOT platform must name one (sglang raises otherwise); the one that needs no kernels
        return "torch_native"


def activate() -> str | None:
    """sglang's platform entry point: this class's qualified name when selected, else None."""
    if os.environ.get("SGLANG_PLATFORM", "") != NAME or torch.cuda.is_available():
        return None
    _stub_torchvision_if_missing()
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
