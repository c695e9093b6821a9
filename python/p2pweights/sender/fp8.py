"""BF16 -> FP8 block quantization on the sender: the formula lives in ``models/fp8_format.py``
(layer 1, so the replica's checks make the same FP8 checkpoint); this module holds the batched
entry point the quantize-on-send transform uses (:func:`quantize_many`) and which weights a trainer
pushes in BF16 (:func:`quantized_pairs`)."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, Tuple

from ..errors import NonFiniteTensor
from ..models.fp8_format import DEFAULT_BLOCK, quantize_block_fp8
from ..models.quant import FP8_DTYPE, scale_name

#: input bytes :func:`quantize_many` quantizes per call of the formula (its extra memory: one copy)
MAX_BATCH_BYTES = 1 << 30
#: the dtypes a trainer may push for a weight the engine holds in FP8 (quantized on send)
TRAINER_DTYPES = ("bfloat16", "float16", "float32")


def quantized_pairs(specs: Mapping[str, Any]) -> dict[str, str]:
    """HF weight name -> its scale's HF name, for every weight an engine checkpoint (``specs``:
    HF name -> ``.dtype``) holds as float8_e4m3fn with a ``weight_scale_inv``: the weights a trainer
    pushes in BF16 (quantized on send) or pre-quantized with their scale. Empty for an unquantized
    checkpoint."""
    return {n: scale_name(n) for n, s in specs.items() if s.dtype == FP8_DTYPE and scale_name(n) in specs}


def quantize_many(weights: Sequence[Any], block: Tuple[int, int] = DEFAULT_BLOCK, scale_fmt: Optional[str] = None,
                  names: Optional[Sequence[str]] = None, max_batch_bytes: int = MAX_BATCH_BYTES) -> list:
    """:func:`quantize_block_fp8` of several 2-D weights of one shape, dtype and device (a layer's
    experts): ``[(fp8_weight, scale_inv), ...]`` in input order, byte for byte what one call per
    weight gives.

    The weights are stacked row-wise, each padded with zero rows to a whole number of blocks, and
    quantized by ONE call of the formula per ``max_batch_bytes`` of input: no block spans two
    weights and zero rows change no block's amax, so every block and its scale are the per-tensor
    ones, while the per-call costs (kernel launches, the NaN check's device synchronisation) are
    paid once per chunk instead of once per weight. Extra memory: one chunk's copy. NaN or Inf in
    any weight: :class:`NonFiniteTensor` naming that weight, and nothing is returned.
    """
    import torch

    weights = list(weights)
    names = [f"weight {i}" for i in range(len(weights))] if names is None else list(names)
    if len(names) != len(weights):
        raise ValueError(f"quantize_many: {len(names)} names for {len(weights)} weights")
    if len(weights) <= 1:
        return [quantize_block_fp8(w, block, scale_fmt, name=n) for w, n in zip(weights, names)]
    first = weights[0]
    for w, n in zip(weights, names):
        if not isinstance(w, torch.Tensor) or w.dim() != 2:  # the formula's own refusal, naming the tensor
            quantize_block_fp8(w, block, scale_fmt, name=n)
        if w.shape != first.shape or w.dtype != first.dtype or w.device != first.device:
            raise ValueError(f"quantize_many takes weights of one shape, dtype and device: {n!r} is "
                             f"{tuple(w.shape)} {w.dtype} on {w.device}, {names[0]!r} is {tuple(first.shape)} "
                             f"{first.dtype} on {first.device}")
    rows, cols = first.shape
    bo = int(block[0])
    if bo <= 0:  # the formula's own refusal of the block
        quantize_block_fp8(first, block, scale_fmt, name=names[0])
    padded_rows = -(-rows // bo) * bo
    per_call = max(1, int(max_batch_bytes) // max(1, padded_rows * cols * first.element_size()))
    out: list = []
    for start in range(0, len(weights), per_call):
        chunk = weights[start:start + per_call]
        if len(chunk) == 1:
            out.append(quantize_block_fp8(chunk[0], block, scale_fmt, name=names[start]))
            continue
        if padded_rows == rows:
            stacked = torch.cat(chunk, dim=0)
        else:
            stacked = torch.zeros((len(chunk), padded_rows, cols), dtype=first.dtype, device=first.device)
            for i, w in enumerate(chunk):
                stacked[i, :rows] = w
            stacked = stacked.view(len(chunk) * padded_rows, cols)
        try:
            q, s = quantize_block_fp8(stacked, block, scale_fmt, name=names[start])
        except NonFiniteTensor:
            bad = next(i for i, w in enumerate(chunk) if not bool(torch.isfinite(w).all()))
            raise _non_finite(chunk[bad], names[start + bad]) from None
        q = q.view(len(chunk), padded_rows, cols)
        s = s.view(len(chunk), padded_rows // bo, s.shape[1])
        for i in range(len(chunk)):
            out.append((q[i] if padded_rows == rows else q[i, :rows].contiguous(), s[i]))
    return out


def _non_finite(weight: Any, name: str) -> NonFiniteTensor:
    import torch

    bad = int((~torch.isfinite(weight)).sum())
    return NonFiniteTensor(
        f"HF tensor {name!r} holds {bad} NaN/Inf value(s) of {weight.numel()}; it was not quantized to FP8",
        parameter=name, hint="fix the training step; FP8 scales cannot be computed from NaN/Inf")


__all__ = ["MAX_BATCH_BYTES", "TRAINER_DTYPES", "quantize_many", "quantized_pairs"]
