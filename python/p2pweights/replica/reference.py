"""The reference model: sglang's model of one engine rank, loaded by sglang's own ``load_weights``
from the HF tensors ``random_checkpoint(specs, seed)`` makes. The one implementation behind both
byte-exactness checks:

- ``p2pweights check-layout`` (:mod:`p2pweights.replica.check`) compares the replica path's slot
  bytes with the parameters of :func:`reference_model` (as loaded, not post-processed);
- the receiver's equality check (``--check-weight-update-equal``) compares an engine rank's live
  model, after the update and its ``end_weight_update``, with a :class:`ReferenceModel` loaded and
  post-processed as sglang's ``end_weight_update`` does after a loader ran
  (``restore_weights_before_loading`` -> ``load_weights`` -> ``postprocess_weights``), tensor by
  tensor (:func:`named_state`: parameters, buffers and derived tensors such as DeepSeek's
  ``w_kc``/``w_vc``), with :func:`compare_models`.

Inputs are made per HF name from a seed (``random_tensor``), so neither side of a check holds the
whole checkpoint twice.
"""
from __future__ import annotations

import fnmatch
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable

from ..models import load_config
from ..models.checkpoint import changed_version, checkpoint_tensors, random_checkpoint
from ..models.quant import quant_scheme
from . import fp8_engine, sglang_env

if TYPE_CHECKING:
    import torch


def reference_model(config: Any, engine: Any, rank: int, *, seed: int = 0, post_process: bool = False,
                    model: "torch.nn.Module | None" = None,
                    changed: "tuple[float, int] | None" = None) -> "torch.nn.Module":
    """sglang's own loader into a fully materialized, zeroed CPU model of the rank (every HF tensor of
    ``random_checkpoint(checkpoint_tensors(config), seed, quant_scheme(config))``: for an FP8 config the
    engine's checkpoint, quantized from seeded BF16 tensors). ``post_process``: also run what an update
    session runs around a loader (restore before, ``postprocess_weights`` after). ``model``: reload
    this reference (built by an earlier call) instead of building a new one. ``changed=(fraction,
    steps)``: that version of the seed's changed family (``models.checkpoint``).

    A Blackwell layout (``gpu_arch=sm100``) post-processed is built anew every time (its requantized
    weights and packed int32 scales cannot be loaded again), and then runs the update session's hooks
    (``run_update_session_hooks``): what an sm100 engine holds once an update's ``end_weight_update``
    ran over those bytes -- the same parameters (its ``format_ue8m0`` gate), and DeepSeek's derived
    ``w_kc``/``w_vc`` recomputed by ``post_load_weights`` from the requantized ``kv_b_proj`` (after
    sglang's own first load they come from the checkpoint's bytes, before requantization)."""
    import torch

    blackwell = post_process and fp8_engine.is_blackwell(engine)
    if model is None or blackwell:  # post-processed sm100 parameters (packed int32 scales) take no second load
        model = sglang_env.materialize(sglang_env.build_model(config, engine, rank, device="meta"), "cpu")
    from sglang.srt.model_loader.loader import DefaultModelLoader  # importable once build_model prepared sglang

    cpu = torch.device("cpu")
    with sglang_env.activate(model):
        if post_process:
            DefaultModelLoader.restore_weights_before_loading(model, cpu)
        cfg = load_config(config)  # an FP8 config: quantized seeded BF16, as a sender quantizing on send makes it
        model.load_weights(random_checkpoint(checkpoint_tensors(cfg), int(seed), quant_scheme(cfg),
                                             changed=changed))  # + post_load_weights
        if post_process:
            DefaultModelLoader.postprocess_weights(model, cpu)
    if blackwell:  # the update session's end over those bytes: derived tensors from the requantized weights
        sglang_env.run_update_session_hooks(model)
    return model


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


def tensor_bytes(t: "torch.Tensor") -> "torch.Tensor":
    """A tensor's bytes as a flat uint8 tensor (bool as 0/1 bytes)."""
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
    changed: tuple[float, int] | None = None  # the version of the seed's changed family compared with

    @property
    def equal(self) -> bool:
        return not self.mismatches

    def to_dict(self) -> dict[str, Any]:
        version = {"changed_fraction": self.changed[0], "changed_steps": self.changed[1]} if self.changed else {}
        return {"rank": self.rank, "equal": self.equal, "hf_seed": self.seed, **version, "compared": self.compared,
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
        ab, bb = tensor_bytes(a), tensor_bytes(b)
        result.bytes += ab.numel()
        if not torch.equal(ab, bb):
            differ = (ab != bb).nonzero()
            result.mismatches.append(Mismatch(
                name, f"{differ.numel()} of {ab.numel()} bytes differ (first at byte {int(differ[0])})"))
    result.seconds = time.perf_counter() - t0
    return result


class ReferenceModel:
    """The post-processed :func:`reference_model` of one engine rank, kept by an engine-rank
    process: built on first use, reloaded only when the checkpoint (seed, changed version) changes."""

    def __init__(self, config: Any, engine: Any, rank: int):
        self.config, self.engine, self.rank = config, engine, int(rank)
        self.model: "torch.nn.Module | None" = None
        self.seed: int | None = None
        self.changed: tuple[float, int] | None = None
        self._lock = threading.Lock()

    def loaded(self, seed: int, changed: tuple[float, int] | None = None) -> tuple["torch.nn.Module", float]:
        """The reference loaded from seed ``seed``, version ``changed`` of its changed family (and the
        seconds spent loading it now, 0 if cached)."""
        changed = changed_version(changed)
        with self._lock:
            if self.model is not None and self.seed == seed and self.changed == changed:
                return self.model, 0.0
            t0 = time.perf_counter()
            self.seed = None
            self.model = reference_model(self.config, self.engine, self.rank, seed=int(seed), post_process=True,
                                         model=self.model, changed=changed)
            self.seed, self.changed = int(seed), changed
            return self.model, time.perf_counter() - t0

    def compare(self, live: "torch.nn.Module", seed: int, skip: Iterable[str] = (), *,
                changed: tuple[float, int] | None = None) -> RankComparison:
        reference, seconds = self.loaded(seed, changed)
        result = compare_models(live, reference, rank=self.rank, seed=int(seed), skip=skip)
        result.reference_seconds, result.changed = seconds, self.changed
        return result
