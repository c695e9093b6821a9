"""The equality check (``--check-weight-update-equal``): an engine rank's weights, byte for byte,
against what sglang's own ``load_weights`` makes of the same full HF tensors in the same process.

After an update, each engine rank compares every parameter, buffer and derived tensor (tensor
attributes that post-processing sets on modules, such as DeepSeek's ``w_kc``/``w_vc``) of its live
model with a *reference model* of the same rank: sglang's model class, loaded by sglang's
``load_weights`` from the HF tensors ``random_checkpoint(specs, seed)`` regenerates, then
post-processed as sglang's ``end_weight_update`` does after a loader ran
(``restore_weights_before_loading`` -> ``load_weights`` -> ``postprocess_weights``). The live model
was post-processed by the receiver's own ``end_weight_update`` (``post_load_weights`` +
``postprocess_weights``), so the check covers both the written bytes and the post-processing.

One reference model per engine-rank process, built on first use and reloaded only when the seed
changes (:class:`ReferenceModel`).
"""
from __future__ import annotations

import fnmatch
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    import torch


def named_state(model: "torch.nn.Module") -> dict[str, "torch.Tensor"]:
    """Every tensor a rank's weights consist of: parameters, buffers, and tensor attributes of
    modules (derived weights post-processing sets, e.g. ``model.layers.0.self_attn.w_kc``)."""
    import torch

    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[name] = p.detach()
    for name, b in model.named_buffers():
        out.setdefault(name, b)
    for mod_name, mod in model.named_modules():
        for attr, value in vars(mod).items():
            if isinstance(value, torch.Tensor) and not attr.startswith("_"):
                out.setdefault(f"{mod_name}.{attr}" if mod_name else attr, value.detach())
    return out


def _as_bytes(t: "torch.Tensor") -> "torch.Tensor":
    import torch

    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


@dataclass
class Mismatch:
    name: str
    why: str

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "why": self.why}


@dataclass
class RankComparison:
    """One engine rank's equality check: ``equal`` unless ``mismatches``."""

    rank: int
    seed: int
    compared: int = 0
    bytes: int = 0
    mismatches: list[Mismatch] = field(default_factory=list)
    seconds: float = 0.0
    reference_seconds: float = 0.0

    @property
    def equal(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "equal": self.equal, "hf_seed": self.seed, "compared": self.compared,
                "bytes": self.bytes, "mismatches": [m.to_dict() for m in self.mismatches],
                "seconds": round(self.seconds, 4), "reference_seconds": round(self.reference_seconds, 4)}


def _skipped(name: str, skip: Iterable[str]) -> bool:
    return any(s in name or fnmatch.fnmatchcase(name, s) for s in skip)


def compare_models(live: "torch.nn.Module", reference: "torch.nn.Module", *, rank: int, seed: int,
                   skip: Iterable[str] = ()) -> RankComparison:
    """Compare every tensor of :func:`named_state` byte for byte; name each one that differs."""
    import torch

    t0 = time.perf_counter()
    skip = list(skip or ())
    result = RankComparison(rank=rank, seed=seed)
    got, want = named_state(live), named_state(reference)
    for name in sorted(set(got) | set(want)):
        if _skipped(name, skip):
            continue
        if name not in got:
            result.mismatches.append(Mismatch(name, "the engine has no such tensor; sglang's loader made one"))
            continue
        if name not in want:
            result.mismatches.append(Mismatch(name, "sglang's loader made no such tensor; the engine has one"))
            continue
        a, b = got[name], want[name]
        if a.device != b.device:  # a VRAM engine against the CPU reference
            a = a.detach().to(b.device)
        result.compared += 1
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            result.mismatches.append(Mismatch(name, f"engine holds {tuple(a.shape)} {a.dtype}, sglang's loader "
                                                    f"makes {tuple(b.shape)} {b.dtype}"))
            continue
        ab, bb = _as_bytes(a), _as_bytes(b)
        result.bytes += ab.numel()
        if not torch.equal(ab, bb):
            differ = (ab != bb).nonzero()
            result.mismatches.append(Mismatch(
                name, f"{differ.numel()} of {ab.numel()} bytes differ (first at byte {int(differ[0])})"))
    result.seconds = time.perf_counter() - t0
    return result


class ReferenceModel:
    """sglang's model of one engine rank, loaded by sglang's own ``load_weights`` from
    ``random_checkpoint(specs, seed)`` and post-processed; built once, reloaded per new seed."""

    def __init__(self, config: Any, engine: Any, rank: int):
        self.config, self.engine, self.rank = config, engine, int(rank)
        self.model: "torch.nn.Module | None" = None
        self.seed: int | None = None
        self._lock = threading.Lock()

    def loaded(self, seed: int) -> tuple["torch.nn.Module", float]:
        """The reference loaded from seed ``seed`` (and the seconds spent loading it now, 0 if cached)."""
        import torch

        from ..replica import sglang_env
        from ..models.checkpoint import checkpoint_tensors, random_checkpoint
        from .engine import materialize_rank_model

        with self._lock:
            if self.model is not None and self.seed == seed:
                return self.model, 0.0
            t0 = time.perf_counter()
            if self.model is None:
                self.model = materialize_rank_model(
                    sglang_env.build_model(self.config, self.engine, self.rank, device="meta"))
            from sglang.srt.model_loader.loader import DefaultModelLoader

            specs = checkpoint_tensors(self.config)
            self.seed = None
            with sglang_env.activate(self.model):
                cpu = torch.device("cpu")
                DefaultModelLoader.restore_weights_before_loading(self.model, cpu)
                self.model.load_weights(random_checkpoint(specs, int(seed)))  # runs post_load_weights itself
                DefaultModelLoader.postprocess_weights(self.model, cpu)
            self.seed = int(seed)
            return self.model, time.perf_counter() - t0

    def compare(self, live: "torch.nn.Module", seed: int, skip: Iterable[str] = ()) -> RankComparison:
        reference, seconds = self.loaded(seed)
        result = compare_models(live, reference, rank=self.rank, seed=int(seed), skip=skip)
        result.reference_seconds = seconds
        return result
