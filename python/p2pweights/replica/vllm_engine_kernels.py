"""The engine's answers to vLLM's kernel oracles, while a rank's vLLM code runs on this host.

vLLM picks a layer's kernel by asking its host: is DeepGEMM there (``is_deep_gemm_supported``), is
FlashInfer's CUTLASS MoE there (``has_flashinfer_cutlass_fused_moe``)? This host has neither (no
``libcuda``), a Hopper engine of vLLM's CUDA wheel has both. :func:`engine_kernels` makes the oracles
of the two kernels whose post-processing p2pweights replays on send (:mod:`.vllm_replay`) hear the
engine's answer, the layout's ``deep_gemm`` / ``flashinfer``, in the one module that asks each:

- ``DeepGemmFp8BlockScaledMMKernel`` (FP8 128x128 block linears): its module's
  ``is_deep_gemm_supported``, ``is_deep_gemm_e8m0_used`` (the engine's ``VLLM_USE_DEEP_GEMM_E8M0``,
  default 1) and ``should_use_deepgemm_for_fp8_linear`` (vLLM's own shape rule: N % 64, K % 128,
  BF16 out), so vLLM's own oracle decides layer by layer which linears DeepGEMM takes;
- ``FlashInferExperts`` (FlashInfer CUTLASS FP8 MoE): its module's ``has_flashinfer_cutlass_fused_moe``,
  so vLLM's FP8 MoE oracle (``oracle/fp8.py``) decides as on an sm90 engine (first under EP).

Every other module keeps the host's answers (``Fp8LinearMethod.use_deep_gemm`` among them: MLA's
derived ``W_UK_T`` / ``W_UV`` are then dequantized by ``scaled_dequantize`` instead of DeepGEMM's GEMM
of an identity; those tensors are never written, the engine derives its own).

**DeepGEMM's scale layout** (``transform_sf_into_required_layout``, a C++ function of DeepGEMM's
CUDA extension, which cannot load here). vLLM calls it after the E8M0 requantization. Its sm90
branch for FP32 weight scales of 128 x 128 blocks (DeepGEMM ``csrc/apis/layout.hpp``: "(FP32, 128,
128) on SM90: no need to transform, check SFB requirements"; its schema ``Tensor(a) sf -> Tensor(a)``)
returns the scales as they are after checking their shape and strides. :func:`_sm90_weight_scale_layout`
is that branch (the same checks, the same tensor back) and refuses every other branch, which this
host cannot reproduce: Blackwell's packed UE8M0 scales, per-token (1 x 128) scales. It was read in
DeepGEMM's source, not run: no machine here loads DeepGEMM (docs/vllm.md).
"""
from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Any, Iterator

from ..errors import UnsupportedLayout
from .vllm_layout import VllmLayout

if TYPE_CHECKING:
    import torch


def _sm90_weight_scale_layout(sf: "torch.Tensor", mn: int, k: int, recipe: Any, num_groups: Any = None,
                              is_sfa: Any = None, disable_ue8m0_cast: bool = False, **_: Any) -> "torch.Tensor":
    """DeepGEMM's ``transform_sf_into_required_layout`` on sm90 for FP32 128 x 128 weight scales (SFB):
    shape and stride checks, then the same tensor. Anything else raises :class:`UnsupportedLayout`."""
    import torch

    recipe = tuple(recipe)
    gran_mn, gran_k = ((recipe[0] if is_sfa else recipe[1]), recipe[2]) if len(recipe) == 3 else recipe
    if sf.dtype != torch.float32 or (gran_mn, gran_k) != (128, 128):
        raise UnsupportedLayout(
            f"DeepGEMM's scale layout for {sf.dtype} scales of {gran_mn} x {gran_k} blocks is a CUDA kernel of "
            "DeepGEMM's extension this host cannot run; p2pweights replays only sm90's FP32 128 x 128 weight "
            "scales, which DeepGEMM keeps as they are")
    grouped = num_groups is not None
    ok = sf.dim() == 2 + grouped and (not grouped or sf.size(-3) == num_groups) \
        and sf.size(-2) == -(-mn // gran_mn) and sf.size(-1) == -(-k // gran_k)
    if grouped:
        ok = ok and sf.stride(-3) == sf.size(-2) * sf.size(-1)
    ok = ok and ((sf.stride(-1) == 1 and sf.stride(-2) == sf.size(-1)) or
                 (sf.stride(-1) == sf.size(-2) and sf.stride(-2) == 1))
    if not ok:
        raise UnsupportedLayout(f"DeepGEMM refuses weight scales of shape {tuple(sf.shape)}, strides {sf.stride()} "
                                f"for a {mn} x {k} weight (its sm90 SFB check)")
    return sf


@contextlib.contextmanager
def engine_kernels(layout: VllmLayout) -> Iterator[None]:
    """While the block runs, the DeepGEMM linear kernel's and FlashInfer CUTLASS MoE's oracles hear
    ``layout``'s answers, and DeepGEMM's sm90 weight-scale layout is :func:`_sm90_weight_scale_layout`.
    The caller holds vllm_env's lock (vLLM's module state is process-global)."""
    import vllm.envs as envs
    import vllm.model_executor.kernels.linear.scaled_mm.deep_gemm as deep_gemm_linear
    import vllm.model_executor.layers.fused_moe.experts.flashinfer_cutlass_moe as flashinfer_moe
    import vllm.utils.deep_gemm as deep_gemm

    deep, flashinfer = bool(layout.deep_gemm), bool(layout.flashinfer)
    patches = [
        (deep_gemm_linear, "is_deep_gemm_supported", lambda: deep),
        (deep_gemm_linear, "is_deep_gemm_e8m0_used", lambda: deep and bool(envs.VLLM_USE_DEEP_GEMM_E8M0)),
        (deep_gemm_linear, "should_use_deepgemm_for_fp8_linear",
         functools.partial(deep_gemm.should_use_deepgemm_for_fp8_linear, supports_deep_gemm=deep)),
        (flashinfer_moe, "has_flashinfer_cutlass_fused_moe", lambda: flashinfer),
        (deep_gemm, "_transform_sf_into_required_layout_impl", _sm90_weight_scale_layout if deep else None),
    ]
    saved = [(module, name, getattr(module, name)) for module, name, _ in patches]
    try:
        for module, name, value in patches:
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
