"""Quantize on send: the group transform that makes an FP8 engine's checkpoint from a trainer's BF16.

An FP8 block-quantized engine (models/quant.py) loads each quantized linear weight as two HF
tensors, ``<module>.weight`` (float8_e4m3fn) and ``<module>.weight_scale_inv`` (float32 per block).
The trainer holds BF16. For every complete parameter group, :class:`QuantizeOnSend` turns each
weight the engine holds in FP8 that came in BF16/FP16/FP32 into that pair with the one formula
(models/fp8_format.py, block and ``scale_fmt`` from the config's scheme), on the device the weight
is on: the trainer's GPU when its tensors are there, the CPU otherwise. Everything else passes
unchanged, pre-quantized pairs included (the stager checked their dtype, shape and pairing).

Throughput: the weights to quantize of one group are bucketed by (shape, dtype, device) and each
bucket is one :func:`quantize_many` call (a MoE layer's experts: a few vectorised calls instead of
one per expert). A weight several prepared engine ranks read (TP: every rank's loaders take the
full HF tensor) is quantized once: with several prepared ranks, the last group's results are reused
when the same, unmodified tensor object comes again under the same name.

NaN/Inf: the inputs' push-time check refuses them first (inputs.py), before anything is written;
the formula refuses them too (:class:`NonFiniteTensor` naming the HF tensor).

The WeightSender installs this transform by itself, after any given ones, when the model's config
has an FP8 scheme (:func:`with_quantize_on_send`).
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable, Mapping, Sequence

from ..models.quant import Fp8Scheme, quant_scheme
from .fp8 import MAX_BATCH_BYTES, quantize_many, quantized_pairs
from .transforms import GroupLoad, GroupTransform


class QuantizeOnSend(GroupTransform):
    """BF16/FP16/FP32 weights of an FP8 engine's quantized layers -> FP8 weight + float32 block scale."""

    def __init__(self, scheme: Fp8Scheme, *, max_batch_bytes: int = MAX_BATCH_BYTES):
        self.scheme = scheme
        self.max_batch_bytes = int(max_batch_bytes)  # input per call of the formula (quantize_many)
        self._pairs: dict[int, tuple[Any, dict[str, str]]] = {}  # id(replica) -> (replica, weight -> scale)
        # several prepared engine ranks read the same HF tensors: HF name -> (weakref to the input,
        # its in-place version, fp8, scale) of the last quantize() call, reused by the next rank's
        self._reuse = False
        self._last: dict[str, tuple[Any, int | None, Any, Any]] = {}

    def connect(self, ranks: Sequence[Any]) -> None:
        self._pairs = {id(p.replica): (p.replica, quantized_pairs(p.replica.hf_specs)) for p in ranks}
        self._reuse = len(ranks) > 1
        self._last = {}

    def _pairs_of(self, replica: Any) -> Mapping[str, str]:
        known = self._pairs.get(id(replica))
        if known is None or known[0] is not replica:
            known = (replica, quantized_pairs(replica.hf_specs))
            self._pairs[id(replica)] = known
        return known[1]

    def __call__(self, load: GroupLoad) -> Iterable[GroupLoad]:
        pairs = self._pairs_of(load.rank.replica)
        todo = [n for n, t in load.tensors.items() if n in pairs and pairs[n] not in load.tensors]
        if not todo:
            return (load,)  # nothing quantized here, or every FP8 weight came pre-quantized
        made: dict[str, Any] = dict(load.tensors)
        for name, (q, scale) in self.quantize({n: load.tensors[n] for n in todo}).items():
            made[name], made[pairs[name]] = q, scale
        # in the group's order, as the loaders would read the engine's checkpoint
        tensors = {n: made[n] for n in load.group.hf_names if n in made}
        tensors.update((n, t) for n, t in made.items() if n not in tensors)  # the replica refuses strays
        return (GroupLoad(load.rank, load.group, tensors),)

    def quantize(self, weights: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
        """HF name -> (float8_e4m3fn weight, float32 scale_inv) of each weight, on its device;
        weights of one shape, dtype and device in one :func:`quantize_many` call."""
        out: dict[str, tuple[Any, Any]] = {}
        buckets: dict[tuple, list[str]] = {}
        for name, w in weights.items():
            hit = self._last.get(name)
            if hit is not None and hit[0]() is w and hit[1] is not None and hit[1] == _version(w):
                out[name] = hit[2], hit[3]
                continue
            buckets.setdefault((tuple(w.shape), w.dtype, w.device), []).append(name)
        for names in buckets.values():
            results = quantize_many([weights[n] for n in names], self.scheme.block, self.scheme.scale_fmt, names,
                                    self.max_batch_bytes)
            out.update(zip(names, results))
        if self._reuse:  # holds one group's FP8 results (never its inputs) until the next group
            self._last = {n: (weakref.ref(weights[n]), _version(weights[n]), q, s) for n, (q, s) in out.items()}
        return out


def _version(tensor: Any) -> int | None:
    """The tensor's in-place modification counter (None where torch keeps none: inference tensors)."""
    try:
        return int(tensor._version)
    except (AttributeError, RuntimeError):
        return None


def with_quantize_on_send(transforms: Sequence[GroupTransform], config: Mapping[str, Any]) -> tuple[GroupTransform, ...]:
    """``transforms`` plus, last, a :class:`QuantizeOnSend` when ``config`` is FP8 block-quantized
    (unless one is given already): given transforms see the trainer's tensors, the loaders get the
    engine checkpoint's."""
    transforms = tuple(transforms)
    scheme = quant_scheme(config)
    if scheme is None or any(isinstance(t, QuantizeOnSend) for t in transforms):
        return transforms
    return transforms + (QuantizeOnSend(scheme),)
