"""FP8 block-quantized engines on the replica's host: what sglang 0.5.23 does on a Hopper GPU, reproduced.

A replica (and the reference model of check-layout and the receiver's equality check) must hold what
an H100/H200 engine holds after loading an FP8 checkpoint (docs/replica.md, "FP8 engines"):

- the checkpoint's own quantization, and no other (:func:`check_quantization`);
- parameters as ``Fp8LinearMethod`` / ``Fp8MoEMethod`` create them; a block that does not tile a
  TP / EP shard is refused naming the parameter (:func:`block_shard_checks`);
- DeepSeek's derived ``w_kc``/``w_vc`` as the CUDA branch of ``post_load_weights`` computes them
  (:func:`post_load_as_on_hopper`). ``process_weights_after_loading`` keeps the bytes on Hopper (no
  DeepGEMM UE8M0 requantization there) and on this host alike; the attention ``k_scale``/``v_scale``
  it sets are never written by a sender (``probe.py``: ``LoaderMapping.derived``).

A layout that names a Blackwell engine (``gpu_arch=sm100``) is built, loaded and post-processed
under that engine's answers instead (:func:`engine_answers`, scoped to those calls), and its
post-processing, which rewrites the bytes, is replayed on send (``sglang_ue8m0.py``).
"""
from __future__ import annotations

import contextlib
import os
import sys
import types
from typing import Any, Iterator

from ..errors import UnsupportedLayout
from ..models import load_config
from ..models.engine_layout import EngineLayout
from ..models.quant import quant_scheme

#: engine architectures whose FP8 post-processing the replica reproduces by replaying it
#: (sglang_ue8m0.py); the default replica is a Hopper engine's
BLACKWELL_ARCHS = ("sm100",)
_FLAGS = ("ENABLE_JIT_DEEPGEMM", "DEEPGEMM_SCALE_UE8M0", "DEEPGEMM_BLACKWELL")
_DEEP_GEMM = ("deep_gemm", "deep_gemm.utils", "deep_gemm.utils.layout")


def post_load_as_on_hopper() -> None:
    """DeepSeek's ``post_load_weights`` derives ``w_kc``/``w_vc`` from an FP8 ``kv_b_proj`` by a
    device-dependent branch: on CUDA with 128x128 blocks it dequantizes (``block_quant_dequant``
    to bf16: float32 multiply, then a round to bf16 -- IEEE, the same bytes on a CPU); elsewhere it
    requantizes to a per-tensor scale (``block_quant_to_tensor_quant``, a different w_kc and an extra
    ``w_scale``). Replicas and reference models reproduce Hopper engines (docs/replica.md), so this
    module's own ``_is_cuda`` flag -- read only by that branch -- says CUDA here. No other module's
    flag changes; on a GPU host it is True already."""
    import sglang.srt.models.deepseek_common.deepseek_weight_loader as deepseek_loader

    deepseek_loader._is_cuda = True


def check_quantization(config: Any, engine: EngineLayout) -> None:
    """The engine's ``quantization`` server arg must be what the checkpoint is: none (sglang reads
    ``quantization_config``), or ``fp8`` for an FP8 block-quantized config. ``fp8`` over a BF16
    checkpoint quantizes online at load (per-channel, not the checkpoint's blocks): refused. A
    config's quantization p2pweights cannot write is refused by ``quant_scheme``."""

    cfg = load_config(config if isinstance(config, (str, os.PathLike, dict)) else config.to_dict())
    scheme = quant_scheme(cfg)
    wanted = engine.get("quantization")
    if wanted in (None, "", "none", "None", "null"):
        return
    if str(wanted).lower() != "fp8" or scheme is None:
        raise UnsupportedLayout(
            f"engine flag quantization={wanted!r} over a {'BF16' if scheme is None else 'FP8'} checkpoint is not "
            "supported: the replica writes the checkpoint's own quantization (quantization_config)",
            engine=engine.describe(), hint="serve an FP8 block-quantized checkpoint without --quantization, or "
            "with --quantization fp8")


@contextlib.contextmanager
def block_shard_checks(engine: EngineLayout, rank: int) -> Iterator[None]:
    """While sglang builds a model: its FP8 methods' "not divisible by weight quantization block"
    ValueError becomes an :class:`UnsupportedLayout` naming the parameter, its shard and the block
    (a block must tile every TP / EP shard, else a rank's scales straddle two ranks' rows)."""
    try:
        from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8LinearMethod, Fp8MoEMethod
    except ImportError:  # pragma: no cover - an sglang without FP8
        yield
        return
    linear, moe, pick = Fp8LinearMethod.create_weights, Fp8MoEMethod.create_weights, Fp8Config.get_quant_method
    prefixes: dict[int, str] = {}  # id(layer) -> its module path (linear layers set .prefix only afterwards)

    def get_quant_method(self: Any, layer: Any, prefix: str) -> Any:
        prefixes[id(layer)] = prefix
        return pick(self, layer, prefix)

    def refuse(e: ValueError, parameter: str, shard: str, block: Any) -> None:
        if "divisible" not in str(e):
            raise e
        raise UnsupportedLayout(
            f"engine layout {engine.describe()} rank {rank}: FP8 block {block[0]}x{block[1]} does not divide the "
            f"shard of {parameter} ({shard}); sglang refuses to load it ({e})",
            engine=engine.describe(), rank=rank, parameter=parameter,
            hint="pick a TP/EP size whose shards are multiples of the block (weight_block_size)") from e

    def linear_create(self: Any, layer: Any, input_size_per_partition: int, output_partition_sizes: list,
                      input_size: int, output_size: int, *args: Any, **kwargs: Any) -> Any:
        try:
            return linear(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                          *args, **kwargs)
        except ValueError as e:
            refuse(e, f"{prefixes.get(id(layer), '?')}.weight",
                   f"rows {'+'.join(str(n) for n in output_partition_sizes)} of {output_size}, columns "
                   f"{input_size_per_partition} of {input_size}", self.quant_config.weight_block_size)

    def moe_create(self: Any, layer: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return moe(self, layer, *args, **kwargs)
        except ValueError as e:
            per_rank = kwargs.get("intermediate_size_per_partition", "?")
            refuse(e, f"{prefixes.get(id(layer)) or getattr(layer, 'layer_name', '?')}.w13_weight",
                   f"expert intermediate size {per_rank} per rank (moe_tp={getattr(layer, 'moe_tp_size', '?')})",
                   self.quant_config.weight_block_size)

    Fp8LinearMethod.create_weights, Fp8MoEMethod.create_weights = linear_create, moe_create
    Fp8Config.get_quant_method = get_quant_method
    try:
        yield
    finally:
        Fp8LinearMethod.create_weights, Fp8MoEMethod.create_weights = linear, moe
        Fp8Config.get_quant_method = pick


def is_blackwell(engine: Any) -> bool:
    """Whether ``engine`` (an EngineLayout) names a Blackwell engine (``gpu_arch=sm100``)."""
    return engine is not None and engine.get("gpu_arch") in BLACKWELL_ARCHS


def _deep_gemm_stand_in() -> dict[str, types.ModuleType]:
    """DeepGEMM's Python surface that sglang's UE8M0 path touches: ``utils.align``,
    ``utils.get_tma_aligned_size`` (DeepGEMM's own arithmetic) and ``utils.layout.
    get_mn_major_tma_aligned_packed_ue8m0_tensor`` as DeepGEMM's torch reference (sglang's copy)."""
    from sglang.srt.layers.quantization import fp8_utils

    root, utils, layout = (types.ModuleType(n) for n in _DEEP_GEMM)

    def align(x: int, y: int) -> int:
        return (x + y - 1) // y * y

    def get_tma_aligned_size(x: int, element_size: int) -> int:
        assert 16 % element_size == 0
        return align(x, 16 // element_size)

    utils.align, utils.get_tma_aligned_size = align, get_tma_aligned_size
    layout.get_mn_major_tma_aligned_packed_ue8m0_tensor = fp8_utils._get_mn_major_tma_aligned_packed_ue8m0_tensor_torch_impl
    root.utils, utils.layout = utils, layout
    root.__p2pw_stand_in__ = True  # type: ignore[attr-defined]
    return dict(zip(_DEEP_GEMM, (root, utils, layout)))


@contextlib.contextmanager
def engine_answers(engine: Any) -> Iterator[None]:
    """While the block runs, sglang answers as on an sm100 engine with DeepGEMM and UE8M0 scales
    (nothing changes for any other layout): ``deep_gemm_wrapper``'s ``ENABLE_JIT_DEEPGEMM``,
    ``DEEPGEMM_SCALE_UE8M0``, ``DEEPGEMM_BLACKWELL`` (in the three modules holding them), the
    platform's ``is_sm100`` / ``is_blackwell`` (sglang's own ``override_platform``) and DeepGEMM's
    Python surface (:func:`_deep_gemm_stand_in`). The caller holds sglang_env's lock."""
    if not is_blackwell(engine):
        yield
        return
    import sglang.srt.layers.deep_gemm_wrapper as wrapper
    import sglang.srt.layers.deep_gemm_wrapper.configurer as configurer
    import sglang.srt.layers.deep_gemm_wrapper.entrypoint as entrypoint
    from sglang.srt.runtime_context import override_platform

    saved_flags = [(m, n, getattr(m, n)) for m in (configurer, entrypoint, wrapper) for n in _FLAGS]
    modules = _deep_gemm_stand_in() if "deep_gemm" not in sys.modules else {}
    try:
        for module, name, _ in saved_flags:
            setattr(module, name, True)
        sys.modules.update(modules)
        with override_platform(is_sm100=True, is_blackwell=True, is_sm90=False):
            yield
    finally:
        for module, name, value in saved_flags:
            setattr(module, name, value)
        for name in modules:
            sys.modules.pop(name, None)


def moe_runner_flags() -> None:
    """In the current runtime context, the MoE runner and A2A flags as sglang's scheduler seeds them
    (``initialize_moe_config``, from the server args): on a Blackwell engine they decide whether
    ``Fp8MoEMethod`` requantizes the experts (``is_deepgemm_moe_runner_backend_enabled``)."""
    from sglang.srt.layers.moe.utils import initialize_moe_config

    initialize_moe_config()
