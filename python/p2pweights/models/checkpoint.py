"""The HF checkpoint of a model config: every tensor's name, shape and dtype, without weights.

Two views of one model (they differ only for an FP8 block-quantized config, ``quant.py``):

- :func:`checkpoint_tensors`: the ENGINE's checkpoint, what sglang's loaders read -- quantized
  weights in float8_e4m3fn, each followed by its float32 ``weight_scale_inv``. The loader probe
  feeds these (as meta tensors) to the replica's loaders;
- :func:`trainer_tensors`: the BF16 tensors a trainer holds (the same names, no scales).

``check-layout`` and the receiver's equality check fill the engine's view with seeded random
values (:class:`RandomCheckpoint`): for an FP8 config, random BF16 trainer tensors quantized with
the one formula (``fp8_format.quantize_block_fp8``), as a sender quantizing on send produces them.
The names and shapes come from the architecture's schema in the model registry (``registry.py`` →
``schema.py``).

``changed=(fraction, steps)``: version ``steps`` of a run whose versions each differ from the
previous one in ``fraction`` of every tensor's elements, uniformly spread (what RL steps do to
BF16 weights; the data of delta updates). Step j changes the elements a Bernoulli(fraction) draw
seeded by (seed, j, name) picks, to the values seed ``seed + j`` gives them. Version 0, or fraction
0, is the seed's checkpoint; fraction 1 makes version k the checkpoint of seed ``seed + k``. An
element each change redraws may draw its old value (BF16 normal values: about 0.1% of the time),
so the measured changed fraction is a hair under ``fraction``. For an FP8 checkpoint the BF16
trainer tensors change and are quantized as ever (a changed element changes its block).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

from ..errors import UnsupportedLayout
from .fp8_format import quantize_block_fp8
from .quant import FP8_DTYPE, Fp8Scheme, engine_checkpoint, quant_scheme, weight_name
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
    """HF tensor name → shape and dtype, for every tensor of the ENGINE's checkpoint: for an FP8
    block-quantized config, quantized weights in float8_e4m3fn plus their float32 block scales."""
    cfg = load_config(config)
    return _specs(engine_checkpoint(_schema_entries(cfg), quant_scheme(cfg)), _dtype(cfg))


def trainer_tensors(config: Any) -> dict[str, TensorSpec]:
    """HF tensor name → shape and dtype of what a trainer holds: the checkpoint in the config's
    dtype (BF16), no scales. The same as :func:`checkpoint_tensors` for an unquantized config."""
    cfg = load_config(config)
    quant_scheme(cfg)  # an unsupported quantization is refused here too, not at the first update
    return _specs(_schema_entries(cfg), _dtype(cfg))


def _dtype(cfg: Mapping[str, Any]) -> str:
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").removeprefix("torch.")


def _schema_entries(cfg: dict) -> Iterator[Any]:
    arch = architecture_of(cfg) or "?"
    spec = registered().get(arch)
    schema = spec.checkpoint if spec is not None else None
    if schema is None:
        known = sorted(a for a, s in registered().items() if s.checkpoint is not None)
        raise UnsupportedLayout(f"architecture {arch} has no checkpoint schema yet; supported: {', '.join(known)}")
    return schema(cfg)


def _specs(entries: Iterator[Any], dtype: str) -> dict[str, TensorSpec]:
    return {name: TensorSpec(tuple(int(d) for d in shape), override or dtype) for name, shape, override in entries}


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


def random_tensor(name: str, spec: TensorSpec, seed: int = 0, *,
                  changed: Optional[tuple[float, int]] = None) -> Any:
    """A random CPU tensor for one HF name; the same name, spec and seed give the same bytes, so
    two loading paths (a sender and an engine's reference) each make their inputs without holding
    the whole checkpoint. Values are a window of a fixed random pool starting at a hash of
    (seed, name), wrapping around: distinct per name and seed, and unaligned across shards.
    ``changed=(fraction, steps)``: version ``steps`` of the changed family (module docstring)."""
    import torch

    version = changed_version(changed)
    if version is not None and version[0] >= 1.0:
        return random_tensor(name, spec, seed + version[1])  # every element redrawn at the last step
    pool = _pool(spec.dtype)
    n = 1
    for d in spec.shape:
        n *= d
    out = torch.empty(n, dtype=pool.dtype)
    start, filled = _window_start(seed, name), 0
    while filled < n:
        take = min(n - filled, _POOL_ELEMENTS - start)
        out[filled:filled + take].copy_(pool[start:start + take])
        filled += take
        start = 0
    if version is not None and n:
        _apply_changes(out, name, spec.dtype, seed, *version)
    return out.view(spec.shape)


def changed_version(changed: Optional[tuple[float, int]]) -> Optional[tuple[float, int]]:
    """``(fraction, steps)`` checked (fraction in [0, 1], steps an integer >= 0); None when the
    version is the seed's checkpoint itself (no argument, no steps, or nothing changes)."""
    if changed is None:
        return None
    fraction, steps = changed
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
        raise ValueError(f"changed fraction must be a number in [0, 1], got {fraction!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"changed steps must be an integer >= 0, got {steps!r}")
    return None if fraction == 0 or steps == 0 else (float(fraction), int(steps))


def _window_start(seed: int, name: str) -> int:
    import hashlib

    digest = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")
    return digest % _POOL_ELEMENTS


def _as_bits(t: Any) -> Any:
    """The same elements as integers of their width: gathers and scatters for every dtype (FP8 too)."""
    import torch

    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _apply_changes(flat: Any, name: str, dtype: str, seed: int, fraction: float, steps: int) -> None:
    """Version ``steps`` over the base values in ``flat``: each element takes the value of the
    last step that changed it. Walks the steps backwards and stops once every element is taken,
    so the work is about ``fraction`` x elements per step, never a pass over the tensor per step
    (at most about ln(elements) / fraction steps are walked: a large fraction stops early)."""
    import torch

    n = flat.numel()
    bits, pool = _as_bits(flat), _as_bits(_pool(dtype))
    taken = torch.zeros(n, dtype=torch.bool) if steps > 1 else None  # set by a later step than the one at hand
    left = n
    for step in range(steps, 0, -1):
        positions = _changed_positions(seed, step, name, n, fraction)
        if taken is not None:
            if step < steps:
                positions = positions[~taken.index_select(0, positions)]
            taken.index_fill_(0, positions, True)
        at = positions + _window_start(seed + step, name)  # random_tensor(name, spec, seed + step)'s values
        # one wrap at most unless the tensor outsizes the pool (a scalar % costs a division per element)
        at = at % _POOL_ELEMENTS if n > _POOL_ELEMENTS else torch.where(at >= _POOL_ELEMENTS, at - _POOL_ELEMENTS, at)
        bits.scatter_(0, positions, pool.index_select(0, at))
        left -= positions.numel()
        if left == 0:
            break


def _changed_positions(seed: int, step: int, name: str, n: int, fraction: float) -> Any:
    """The sorted positions among ``n`` that ``step`` changes: each one independently with
    probability ``fraction`` (gaps between picks are geometric), from a generator seeded by
    (seed, step, name) alone. Costs about ``fraction * n`` draws."""
    import hashlib

    import torch

    key = int.from_bytes(hashlib.sha256(f"changed:{seed}:{step}:{name}".encode()).digest()[:8], "little")
    gen = torch.Generator().manual_seed(key >> 1)  # manual_seed takes < 2**63
    chunks, last = [], -1
    while last < n - 1:
        draws = int((n - 1 - last) * fraction * 1.05) + 64  # a function of (n, fraction, last): reproducible
        gaps = torch.empty(draws, dtype=torch.float64).geometric_(fraction, generator=gen)
        picks = gaps.clamp_(max=n + 1).to(torch.int64).cumsum_(0).add_(last)
        chunks.append(picks[picks < n])
        last = int(picks[-1])
    return torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.int64)


class RandomCheckpoint:
    """Seeded random tensors of a checkpoint (the engine's view, :func:`checkpoint_tensors`), by
    name. Unquantized names: :func:`random_tensor`. With an FP8 ``scheme``, a quantized weight and
    its ``weight_scale_inv`` are ``quantize_block_fp8`` of the random BF16 trainer tensor of the
    weight's name (``random_tensor(name, trainer spec, seed)``, what a trainer sending
    ``trainer_tensors`` with that seed holds): both paths of a check make the same FP8 checkpoint a
    sender quantizing on send produces. The last quantized pair is kept, so a weight and its scale
    asked for one after the other (they share a parameter group) are quantized once. ``changed``:
    version ``steps`` of the changed family, ``(fraction, steps)`` (module docstring)."""

    def __init__(self, specs: Mapping[str, TensorSpec], seed: int = 0, scheme: Optional[Fp8Scheme] = None, *,
                 changed: Optional[tuple[float, int]] = None):
        self.specs, self.seed, self.scheme = specs, int(seed), scheme
        self.changed = changed_version(changed)
        self._last: tuple[str, Any, Any] | None = None

    def tensor(self, name: str) -> Any:
        spec = self.specs[name]
        weight = weight_name(name)
        if self.scheme is not None and weight is not None and self.specs.get(weight, spec).dtype == FP8_DTYPE:
            return self._quantized(weight)[1]
        if spec.dtype == FP8_DTYPE:
            if self.scheme is None:
                raise ValueError(f"HF tensor {name!r} is {FP8_DTYPE}: random values of an FP8 checkpoint are "
                                 "quantized BF16 ones; pass the config's quant_scheme")
            return self._quantized(name)[0]
        return random_tensor(name, spec, self.seed, changed=self.changed)

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for name in self.specs:
            yield name, self.tensor(name)

    def _quantized(self, weight: str) -> tuple[Any, Any]:
        if self._last is None or self._last[0] != weight:
            assert self.scheme is not None
            source = random_tensor(weight, TensorSpec(self.specs[weight].shape, self.scheme.source_dtype), self.seed,
                                   changed=self.changed)
            q, scale = quantize_block_fp8(source, self.scheme.block, self.scheme.scale_fmt, name=weight)
            self._last = (weight, q, scale)
        return self._last[1], self._last[2]


def random_checkpoint(specs: Mapping[str, TensorSpec], seed: int = 0, scheme: Optional[Fp8Scheme] = None, *,
                      changed: Optional[tuple[float, int]] = None) -> Iterator[tuple[str, Any]]:
    """(name, random CPU tensor) for each spec, one at a time (see :func:`random_tensor`; an FP8
    checkpoint needs its ``scheme``: :class:`RandomCheckpoint`). ``changed=(fraction, steps)``:
    version ``steps`` of the changed family of ``seed`` (module docstring)."""
    return iter(RandomCheckpoint(specs, seed, scheme, changed=changed))
