"""FP8 block-quantized checkpoints: which HF tensors an FP8 engine holds as FP8 + block scales.

A config whose ``quantization_config`` says ``quant_method: fp8`` with a ``weight_block_size``
(DeepSeek-V3, Kimi-K2, GLM FP8 and Qwen3 FP8 checkpoints) is served by sglang 0.5.23 with
``Fp8LinearMethod`` / ``Fp8MoEMethod``: each quantized linear layer loads two HF tensors,
``<module>.weight`` (float8_e4m3fn, the BF16 weight's shape) and ``<module>.weight_scale_inv``
(float32, one per ``block`` tile). Two views of one model follow from that:

- the *trainer's* tensors: the BF16 checkpoint schema (``models/schema.py``), what a trainer holds;
- the *engine's* checkpoint: the same names, with every quantized weight in float8_e4m3fn and its
  scale added right after it (:func:`engine_checkpoint`). This is what the replica's loaders read.

Which weights are quantized: 2-D ``*_proj.weight`` tensors (and MLA's ``kv_a_proj_with_mqa.weight``)
of linear layers that take the quant config -- attention, dense and shared MLPs, routed experts --
unless a module is listed in ``ignored_layers`` / ``modules_to_not_convert`` (matched on dotted
module paths, with and without the ``model.`` prefix, as sglang's ``is_layer_skipped`` does). Never
quantized: embeddings, the LM head, norms, the MoE router (``mlp.gate``, a plain parameter),
``e_score_correction_bias`` and the MTP layer's ``eh_proj`` (an ``nn.Linear`` in sglang's NextN
models for fp8). A weight and its scale always travel in one parameter group (``replica/groups.py``
joins them: they feed two parameters of one layer, and sglang reads them together).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Tuple

from ..errors import UnsupportedLayout

FP8_DTYPE = "float8_e4m3fn"
SCALE_DTYPE = "float32"
SCALE_SUFFIX = "_scale_inv"  # "<module>.weight" -> "<module>.weight_scale_inv"
#: the linear layers that take the quant config, by the last part of their module name (q_proj,
#: gate_proj, ..., and DeepSeek MLA's kv_a_proj_with_mqa, fused with q_a_proj by sglang's loader)
_LINEAR_SUFFIXES = ("_proj", "_proj_with_mqa")
#: modules that are linear layers by name but never take the quant config in sglang's fp8 path
_NEVER_QUANTIZED = ("eh_proj",)


@dataclass(frozen=True)
class Fp8Scheme:
    """How an FP8 block-quantized checkpoint stores a model (from its ``quantization_config``)."""

    block: Tuple[int, int]  # weight_block_size: [rows (out), cols (in)] of one scale tile
    scale_fmt: Optional[str] = None  # None (float32 scales) or "ue8m0" (power-of-two scales)
    ignored: Tuple[str, ...] = ()  # module paths kept unquantized, as listed in the config
    activation_scheme: str = "dynamic"
    source_dtype: str = "bfloat16"  # the trainer's dtype (the config's torch_dtype): what gets quantized

    def quantizes(self, hf_name: str, shape: Tuple[int, ...]) -> bool:
        """True when the engine holds ``hf_name`` as an FP8 weight with a block scale."""
        if not hf_name.endswith(".weight") or len(shape) != 2:
            return False
        module = hf_name[: -len(".weight")]
        last = module.rsplit(".", 1)[-1]
        if not last.endswith(_LINEAR_SUFFIXES) or last in _NEVER_QUANTIZED:
            return False
        return not self.skips(module)

    def skips(self, module: str) -> bool:
        """``module`` (``model.layers.0.self_attn.q_proj``) is listed as not converted."""
        return any(_module_path_match(ignored, module) for ignored in _normalized(self.ignored))

    def scale_shape(self, shape: Tuple[int, ...]) -> Tuple[int, int]:
        """[ceil(out / block_out), ceil(in / block_in)] for a weight of ``shape``."""
        (rows, cols), (bo, bi) = shape, self.block
        return -(-rows // bo), -(-cols // bi)

    def describe(self) -> dict[str, Any]:
        return {"quant_method": "fp8", "weight_block_size": list(self.block), "scale_fmt": self.scale_fmt,
                "ignored_layers": list(self.ignored), "activation_scheme": self.activation_scheme}


def scale_name(weight_name: str) -> str:
    """The HF name of a quantized weight's block scale."""
    return weight_name + SCALE_SUFFIX


def weight_name(scale: str) -> Optional[str]:
    """The weight a ``*.weight_scale_inv`` name scales (None for any other name)."""
    return scale[: -len(SCALE_SUFFIX)] if scale.endswith(".weight" + SCALE_SUFFIX) else None


def quant_scheme(config: Mapping[str, Any]) -> Optional[Fp8Scheme]:
    """The FP8 scheme of a config, None for an unquantized one. A quantization p2pweights cannot
    produce (another method, per-tensor FP8 without block scales, activation scales) raises
    :class:`UnsupportedLayout` saying so."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = str(qc.get("quant_method", "")).lower()
    arch = (config.get("architectures") or ["?"])[0]
    if method != "fp8":
        raise UnsupportedLayout(
            f"{arch}: quantization_config.quant_method={method!r} is not supported; p2pweights writes "
            f"BF16/FP16 engines and FP8 block-quantized ones (quant_method 'fp8' with weight_block_size)",
            hint="serve the BF16 checkpoint, or an FP8 one with weight_block_size [128, 128]")
    block = qc.get("weight_block_size")
    if not block or len(block) != 2 or int(block[0]) <= 0 or int(block[1]) <= 0:
        raise UnsupportedLayout(
            f"{arch}: FP8 without weight_block_size (per-tensor scales) is not supported; got {block!r}",
            hint="use a block-quantized FP8 checkpoint (weight_block_size: [128, 128])")
    activation = str(qc.get("activation_scheme", "dynamic"))
    if activation != "dynamic":
        raise UnsupportedLayout(
            f"{arch}: FP8 activation_scheme={activation!r} needs static activation scales no trainer "
            f"produces; only 'dynamic' is supported", hint="serve with activation_scheme 'dynamic'")
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "ue8m0"):
        raise UnsupportedLayout(f"{arch}: FP8 scale_fmt={scale_fmt!r} is not supported (None or 'ue8m0')")
    ignored = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    source = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16").removeprefix("torch.")
    return Fp8Scheme((int(block[0]), int(block[1])), scale_fmt, ignored, activation, source)


Entry = Tuple[str, Tuple[int, ...], Optional[str]]


def engine_checkpoint(entries: Iterator[Entry], scheme: Optional[Fp8Scheme]) -> Iterator[Entry]:
    """The trainer's schema entries -> the engine checkpoint's: each quantized weight in FP8,
    followed by its float32 block scale. Unchanged without a scheme."""
    for name, shape, dtype in entries:
        if scheme is not None and scheme.quantizes(name, shape):
            yield name, shape, FP8_DTYPE
            yield scale_name(name), scheme.scale_shape(shape), SCALE_DTYPE
        else:
            yield name, shape, dtype


def _normalized(ignored: Tuple[str, ...]) -> Iterator[str]:
    for layer in ignored:  # sglang keeps both the "model." and the bare form of every entry
        base = layer.removeprefix("model.")
        yield base
        yield f"model.{base}"


def _module_path_match(ignored: str, module: str) -> bool:
    """Match on dotted module-path boundaries (``mlp.gate`` must not match ``mlp.gate_proj``)."""
    ignored, module = ignored.rstrip("."), module.rstrip(".")
    return ignored == module or module.startswith(ignored + ".") or f".{ignored}." in f".{module}."
