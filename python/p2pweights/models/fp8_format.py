"""BF16 -> FP8 block quantization: the one formula that defines the bytes of an FP8 engine's weights.

sglang 0.5.23 has no BF16 -> FP8 block quantizer on its load path; on Hopper it keeps the checkpoint's
``weight`` (float8_e4m3fn) and ``weight_scale_inv`` (float32, one per ``block`` tile) as they are, so
what this module computes is what the engine holds. The formula, all in float32 (docs/fp8.md)::

    amax      = max |w| over the block
    scale_inv = max(amax / 448, 2**-126)          # 448: E4M3 max; 2**-126: smallest normal float32
    scale_inv = 2**ceil(log2(scale_inv))          # only with scale_fmt="ue8m0" (exact, on the bits)
    q         = clamp(w * (1 / scale_inv), -448, 448).to(float8_e4m3fn)   # round to nearest even

``1 / scale_inv`` then a multiply, as sglang's and DeepGEMM's ``per_block_cast_to_fp8`` do. Each
division is the correctly rounded float32 result (computed tensor by tensor in float64, then rounded)
and the multiply and the cast are IEEE on CPU and CUDA, so the bytes do not depend on the device
(benchmarks/gpu/bench_fp8.py checks it on a GPU).
The dequantization an engine applies is ``q.to(float32) * scale_inv`` per block.

It lives in ``models/`` (layer 1) because both sides need it: the sender quantizes a trainer's BF16
tensors with it (``sender/fp8.py``'s batched ``quantize_many``), and the replica's checks (``check-layout``, the
reference model) make the same FP8 checkpoint from seeded BF16 tensors.
"""
from __future__ import annotations

from typing import Optional, Tuple

from ..errors import NonFiniteTensor, UnsupportedTensor

#: the largest finite float8_e4m3fn value
FP8_E4M3_MAX = 448.0
#: the smallest normal float32 (2**-126): the floor of every scale, so an all-zero block's scale_inv
MIN_SCALE_INV = 2.0 ** -126
#: the block size of DeepSeek-V3 / Kimi-K2 / GLM FP8 checkpoints (``weight_block_size``)
DEFAULT_BLOCK = (128, 128)
SCALE_FORMATS = (None, "ue8m0")


def scale_shape(shape: Tuple[int, int], block: Tuple[int, int] = DEFAULT_BLOCK) -> Tuple[int, int]:
    """The shape of ``weight_scale_inv`` for a weight of ``shape``: [ceil(out/bo), ceil(in/bi)]."""
    (rows, cols), (bo, bi) = shape, block
    return -(-rows // bo), -(-cols // bi)


def quantize_block_fp8(weight, block: Tuple[int, int] = DEFAULT_BLOCK, scale_fmt: Optional[str] = None,
                       name: str = "weight"):
    """Quantize a 2-D BF16/FP16/FP32 ``weight`` [out, in] into ``(fp8_weight, scale_inv)``.

    ``fp8_weight``: float8_e4m3fn, same shape and device; ``scale_inv``: float32
    [ceil(out/block[0]), ceil(in/block[1])], the dequantization multiplier of each block. Edge blocks
    that are partial (out or in not a multiple of the block) are quantized over the elements they
    have. ``scale_fmt="ue8m0"`` rounds each scale up to a power of two first. NaN or Inf anywhere:
    :class:`NonFiniteTensor` naming ``name``, and nothing is produced.
    """
    import torch

    bo, bi = _check(weight, block, name)
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt {scale_fmt!r} of {name!r}: expected one of {SCALE_FORMATS}")
    rows, cols = weight.shape
    sr, sc = scale_shape((rows, cols), (bo, bi))
    w = weight
    if (sr * bo, sc * bi) != (rows, cols):  # pad with zeros: they do not change any block's amax
        w = torch.zeros((sr * bo, sc * bi), dtype=weight.dtype, device=weight.device)
        w[:rows, :cols] = weight
    blocks = w.reshape(sr, bo, sc, bi)
    # abs and max are exact in any float dtype: amax in the input's dtype equals amax in float32
    # (reducing the contiguous dimension first is ~2x faster on CPU than amax(dim=(1, 3)))
    amax = blocks.abs().amax(dim=3).amax(dim=1).to(torch.float32)
    if not bool(torch.isfinite(amax).all()):  # max propagates NaN; Inf stays Inf
        bad = int((~torch.isfinite(weight)).sum())
        raise NonFiniteTensor(
            f"HF tensor {name!r} holds {bad} NaN/Inf value(s) of {weight.numel()}; it was not quantized to FP8",
            parameter=name, hint="fix the training step; FP8 scales cannot be computed from NaN/Inf")
    # Both divisions are correctly rounded float32 results on every device: divided tensor by tensor
    # in float64, then rounded (exact for division: 53 >= 2 * 24 + 2 bits). A float32 division by a
    # Python scalar is not: on CUDA torch multiplies by the scalar's reciprocal instead (measured on
    # the H200: ~0.1% of the bytes differed from the CPU's), and so does sglang's own helper there.
    amax64 = amax.to(torch.float64)
    scale_inv = torch.clamp_min((amax64 / torch.full_like(amax64, FP8_E4M3_MAX)).to(torch.float32), MIN_SCALE_INV)
    if scale_fmt == "ue8m0":
        scale_inv = ceil_to_power_of_two(scale_inv)
    scale64 = scale_inv.to(torch.float64)
    reciprocal = (torch.ones_like(scale64) / scale64).to(torch.float32)[:, None, :, None]
    q = torch.mul(blocks, reciprocal).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    q = q.reshape(sr * bo, sc * bi)
    if q.shape != (rows, cols):
        q = q[:rows, :cols].contiguous()
    return q, scale_inv.contiguous()


def dequantize_block_fp8(fp8_weight, scale_inv, block: Tuple[int, int] = DEFAULT_BLOCK):
    """``fp8_weight.to(float32) * scale_inv`` of its block, as an engine dequantizes: float32 [out, in]."""
    import torch

    rows, cols = fp8_weight.shape
    bo, bi = block
    if tuple(scale_inv.shape) != scale_shape((rows, cols), (bo, bi)):
        raise ValueError(f"scale_inv of shape {tuple(scale_inv.shape)} does not fit a weight {rows}x{cols} "
                         f"in {bo}x{bi} blocks: expected {scale_shape((rows, cols), (bo, bi))}")
    full = scale_inv.to(torch.float32).repeat_interleave(bo, dim=0).repeat_interleave(bi, dim=1)
    return fp8_weight.to(torch.float32) * full[:rows, :cols]


def ceil_to_power_of_two(scale):
    """Each positive normal float32 rounded up to a power of two (UE8M0), exactly: on the bits, not log2."""
    import torch

    bits = scale.to(torch.float32).contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent.clamp(1, 254) << 23).view(torch.float32)


def _check(weight, block, name):
    import torch

    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise UnsupportedTensor(f"HF tensor {name!r}: FP8 block quantization takes a 2-D tensor [out, in], got "
                                f"{getattr(weight, 'shape', type(weight).__name__)}", parameter=name)
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise UnsupportedTensor(f"HF tensor {name!r} is {weight.dtype}: FP8 block quantization takes "
                                f"bfloat16, float16 or float32", parameter=name)
    bo, bi = (int(b) for b in block)
    if bo <= 0 or bi <= 0:
        raise ValueError(f"block {tuple(block)} of {name!r}: both sides must be positive")
    return bo, bi
