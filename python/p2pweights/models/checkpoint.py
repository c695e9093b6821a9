"""The HF checkpoint of a model config: every tensor's name, shape and dtype, without weights.

The loader probe feeds these (as meta tensors) to the replica's loaders, and ``check-layout``
fills them with random values. The names and shapes come from the architecture's schema in the
model registry (``registry.py`` → ``schema.py``).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

from ..errors import UnsupportedLayout
from .registry import architecture_of, load_config, registered


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _element_size(self.dtype)


@functools.lru_cache(maxsize=None)
def _element_size(dtype: str) -> int:
    import torch

    return torch.empty((), dtype=getattr(torch, dtype)).element_size()


def checkpoint_tensors(config: Any) -> dict[str, TensorSpec]:
    """HF tensor name → shape and dtype, for every tensor of the model's checkpoint."""
    cfg = load_config(config)
    arch = architecture_of(cfg) or "?"
    spec = registered().get(arch)
    schema = spec.checkpoint if spec is not None else None
    if schema is None:
        known = sorted(a for a, s in registered().items() if s.checkpoint is not None)
        raise UnsupportedLayout(f"architecture {arch} has no checkpoint schema yet; supported: {', '.join(known)}")
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").removeprefix("torch.")
    out: dict[str, TensorSpec] = {}
    for name, shape, override in schema(cfg):
        out[name] = TensorSpec(tuple(int(d) for d in shape), override or dtype)
    return out


_POOL_ELEMENTS = 16_777_259  # a prime: TP/EP shards of a tensor never line up with the pool's period
_pools: dict[str, Any] = {}


def _pool(dtype: str) -> Any:
    """Normally distributed values, made once per process and dtype (randn of a whole real-size
    checkpoint costs seconds per GB on 2 cores; slicing a pool costs a memcpy)."""
    import torch

    pool = _pools.get(dtype)
    if pool is None:
        gen = torch.Generator().manual_seed(0x5EED)
        pool = torch.randn(_POOL_ELEMENTS, generator=gen, dtype=torch.float32).to(getattr(torch, dtype))
        _pools[dtype] = pool
    return pool


def random_tensor(name: str, spec: TensorSpec, seed: int = 0) -> Any:
    """A random CPU tensor for one HF name; the same name, spec and seed give the same bytes, so
    two loading paths (a sender and an engine's reference) each make their inputs without holding
    the whole checkpoint. Values are a window of a fixed random pool starting at a hash of
    (seed, name), wrapping around: distinct per name and seed, and unaligned across shards."""
    import hashlib

    import torch

    digest = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    pool = _pool(spec.dtype)
    n = 1
    for d in spec.shape:
        n *= d
    out = torch.empty(n, dtype=pool.dtype)
    start, filled = digest % _POOL_ELEMENTS, 0
    while filled < n:
        take = min(n - filled, _POOL_ELEMENTS - start)
        out[filled:filled + take].copy_(pool[start:start + take])
        filled += take
        start = 0
    return out.view(spec.shape)


def random_checkpoint(specs: Mapping[str, TensorSpec], seed: int = 0) -> Iterator[tuple[str, Any]]:
    """(name, random CPU tensor) for each spec, one at a time (see :func:`random_tensor`)."""
    for name, spec in specs.items():
        yield name, random_tensor(name, spec, seed)
