"""Bytes one engine rank holds, as sglang 0.5.23 shards a model, from an HF config.json alone.

This mirrors the constructors of sglang's model classes (qwen3.py, qwen3_moe.py, deepseek_v2.py)
closely enough that the sum matches the parameters of sglang's own model built on the meta device
for that rank (tests/test_plan_meta.py pins it). Which model applies to an architecture is its
registry entry's ``cost`` (registry.py); the shard layout is the one ``EngineLayout``
(engine_layout.py), read here by its attributes (tp, ep, attn_dp, attn_tp, moe_tp,
dp_lm_head, shared_experts_fusion). What a rank holds is kept per section -- the
first-stage tensors (embedding), one entry per decoder layer, the last-stage tensors (final norm,
LM head) -- because a trainer pipeline stage writes only its own layers.

Rules taken from sglang, with why they matter for the bytes:
- attention is sharded over attention TP = tp / dp (DP attention); KV heads are replicated when
  attention TP exceeds them (each rank keeps one);
- the vocabulary is padded to a multiple of 64, or of 64 * shards when that is not divisible;
  the embedding is sharded over attention TP under DP attention, the LM head only with
  dp_lm_head; tied embeddings share one tensor;
- norms, routers (and DeepSeek's fp32 e_score_correction_bias) and MLA's fused
  q_a/kv_a projection are replicated on every rank;
- routed experts are split over EP and their intermediate size over MoE TP = tp / ep; dense MLPs
  and shared experts over full TP;
- FP8 block-quantized configs (``quantization_config``, models/quant.py): each quantized linear
  weight shard is 1 byte per element plus a float32 scale per ``weight_block_size`` tile
  (``Fp8LinearMethod`` / ``Fp8MoEMethod``); embeddings, LM head, norms and routers stay in the
  config's dtype. The attention modules' scalar ``k_scale``/``v_scale`` (set by post-processing,
  never sent) are not counted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import PlanError, UnsupportedLayout
from .engine_layout import EngineLayout
from .quant import Fp8Scheme, quant_scheme
from .registry import architecture_of, registered

DTYPE_BYTES = {"bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "fp32": 4, "float32": 4}
_FP32 = 4
_VOCAB_PADDING = 64  # sglang's DEFAULT_VOCAB_PADDING_SIZE


def costed_architectures() -> tuple[str, ...]:
    """Architectures the bytes-per-engine-rank model knows, in registry order."""
    return tuple(arch for arch, spec in registered().items() if spec.cost is not None)


@dataclass(frozen=True)
class RankBytes:
    """Parameter bytes of one engine rank: first-stage tensors, one entry per decoder layer,
    last-stage tensors."""

    first: int
    layers: tuple[int, ...]
    last: int

    @property
    def total(self) -> int:
        return self.first + sum(self.layers) + self.last

    def of_layers(self, start: int, end: int, *, first: bool, last: bool) -> int:
        """Bytes of the pipeline stage holding layers [start, end)."""
        return (self.first if first else 0) + sum(self.layers[start:end]) + (self.last if last else 0)


@dataclass(frozen=True)
class ModelShape:
    """The fields of an HF config.json that decide how many bytes each shard holds."""

    architecture: str
    kind: str  # the registry entry's cost model: "dense", "moe" or "mla"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    # MoE (Qwen3-MoE and DeepSeek)
    experts: int = 0
    moe_intermediate: int = 0
    # DeepSeek: MLA and which layers are MoE
    shared_experts: int = 0
    first_k_dense: int = 0
    moe_layer_freq: int = 1
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    router_bias_fp32: bool = False
    router_fp32: bool = False
    fp8: Fp8Scheme | None = None  # FP8 block quantization of the linear weights (None: unquantized)

    def is_moe_layer(self, layer: int) -> bool:
        if self.kind == "moe":
            return True  # sglang 0.5.23 builds every Qwen3-MoE layer sparse
        if self.kind == "mla":
            return self.experts > 0 and layer >= self.first_k_dense and layer % self.moe_layer_freq == 0
        return False


def model_shape(config: Mapping[str, Any]) -> ModelShape:
    """Read the sharding-relevant fields of an HF config (a dict of config.json)."""
    arch = architecture_of(config)
    spec = registered().get(arch or "")
    if spec is None or spec.cost is None:
        raise PlanError(
            f"--model: unknown architecture {arch!r}; the cost model knows "
            f"{', '.join(costed_architectures())}. Set \"architectures\" in config.json to one of them "
            "if the model is built the same way."
        )
    c = config
    try:
        fp8 = quant_scheme(c)
    except UnsupportedLayout as e:
        raise PlanError(f"--model: {e}") from None
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    common = dict(
        architecture=arch,
        kind=spec.cost,
        hidden=hidden,
        layers=spec.num_layers(c),
        heads=heads,
        kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or hidden // heads),
        vocab=int(c["vocab_size"]),
        intermediate=int(c["intermediate_size"]),
        tie_word_embeddings=bool(spec.tied_names(c)),
        attention_bias=bool(c.get("attention_bias", False)),
        fp8=fp8,
    )
    if spec.cost == "moe":
        return ModelShape(**common, experts=int(c["num_experts"]), moe_intermediate=int(c["moe_intermediate_size"]))
    if spec.cost == "mla":
        return ModelShape(
            **common,
            experts=int(c.get("n_routed_experts") or 0),
            moe_intermediate=int(c.get("moe_intermediate_size") or 0),
            shared_experts=int(c.get("n_shared_experts") or 0),
            first_k_dense=int(c.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(c.get("moe_layer_freq") or 1),
            q_lora_rank=c.get("q_lora_rank"),
            kv_lora_rank=int(c["kv_lora_rank"]),
            qk_nope_head_dim=int(c["qk_nope_head_dim"]),
            qk_rope_head_dim=int(c["qk_rope_head_dim"]),
            v_head_dim=int(c["v_head_dim"]),
            router_bias_fp32=c.get("topk_method") == "noaux_tc",
            router_fp32=bool(c.get("router_fp32", False)),
        )
    return ModelShape(**common)


def check_shardable(shape: ModelShape, layout: "EngineLayout", flag: str = "--engine") -> None:
    """Refuse a shard layout sglang would refuse (or build wrong) for this model, naming the flag
    to fix. (What holds for any model -- ep and attention DP dividing tp -- the layout type
    itself checks.)"""
    if shape.heads % layout.attn_tp:
        raise PlanError(
            f"{flag}: attention TP {layout.attn_tp} (tp/dp) does not divide the {shape.heads} attention "
            f"heads of {shape.architecture}; use a tp/dp that divides {shape.heads}"
        )
    if shape.kind != "mla":
        kv, atp = shape.kv_heads, layout.attn_tp
        if (kv >= atp and kv % atp) or (kv < atp and atp % kv):
            raise PlanError(
                f"{flag}: attention TP {atp} and the {kv} KV heads must divide one another; change tp or dp"
            )
    if shape.experts:
        if shape.experts % layout.ep:
            raise PlanError(f"{flag}: ep={layout.ep} does not divide the {shape.experts} experts; pick a divisor")
        if shape.moe_intermediate % layout.moe_tp:
            raise PlanError(
                f"{flag}: MoE TP {layout.moe_tp} (tp/ep) does not divide moe_intermediate_size "
                f"{shape.moe_intermediate}; raise ep"
            )
        if layout.tp > shape.experts:
            raise PlanError(f"{flag}: tp={layout.tp} exceeds the {shape.experts} experts (sglang refuses it)")
    elif layout.ep > 1:
        raise PlanError(f"{flag}: ep={layout.ep} on a dense model; drop ep")
    if layout.shared_experts_fusion and shape.shared_experts != 1:
        raise PlanError(f"{flag}: fused_shared_experts needs a model with one shared expert")
    if shape.fp8 is not None:
        _check_fp8_shards(shape, layout, flag)


def _check_fp8_shards(shape: ModelShape, layout: "EngineLayout", flag: str) -> None:
    """Every sharded dimension of a quantized weight must be a multiple of the block (sglang's
    Fp8LinearMethod / Fp8MoEMethod refuse to build otherwise)."""
    assert shape.fp8 is not None
    bo, bi = shape.fp8.block
    atp = layout.attn_tp
    sharded: list[tuple[str, int, int]] = []  # (weight, size of its shard, block side that must divide it)
    if shape.kind == "mla":
        heads = shape.heads // atp
        if atp > 1:
            sharded += [("q_b_proj rows", heads * (shape.qk_nope_head_dim + shape.qk_rope_head_dim), bo),
                        ("kv_b_proj rows", heads * (shape.qk_nope_head_dim + shape.v_head_dim), bo),
                        ("o_proj columns", heads * shape.v_head_dim, bi)]
    elif atp > 1:
        sharded += [("q_proj rows", shape.heads // atp * shape.head_dim, bo),
                    ("k_proj rows", max(1, shape.kv_heads // atp) * shape.head_dim, bo),
                    ("o_proj columns", shape.heads // atp * shape.head_dim, bi)]
    if layout.tp > 1 and shape.intermediate and not (shape.kind == "moe" and shape.experts):
        sharded += [("mlp gate/up rows and down_proj columns", shape.intermediate // layout.tp, max(bo, bi))]
    if shape.experts:
        sharded += [("experts' gate/up rows", shape.moe_intermediate // layout.moe_tp, bo)]
        if layout.moe_tp > 1:
            sharded += [("experts' down_proj columns", shape.moe_intermediate // layout.moe_tp, bi)]
        if shape.shared_experts and layout.tp > 1:
            sharded += [("shared experts' gate/up rows and down_proj columns",
                         shape.moe_intermediate * shape.shared_experts // layout.tp, max(bo, bi))]
    for what, size, block in sharded:
        if size % block:
            raise PlanError(f"{flag}: FP8 block {bo}x{bi} does not divide the {what} of each shard ({size}) of "
                            f"{shape.architecture} at tp={layout.tp}, ep={layout.ep}; pick a layout whose shards are "
                            f"multiples of {block}")


def fuses_shared_experts_by_default(shape: ModelShape, ep: int) -> bool:
    """Whether sglang 0.5.23 fuses the shared expert into the routed experts when the engine is
    started without --disable/--enforce-shared-experts-fusion, on an NVIDIA GPU (sm80+) with an
    unquantized checkpoint: only DeepSeek-V3's own shape (256 experts, one shared), without EP."""
    return (
        shape.architecture == "DeepseekV3ForCausalLM"
        and shape.experts == 256
        and shape.shared_experts == 1
        and ep == 1
    )


def fuses_shared_experts(shape: ModelShape, layout: "EngineLayout") -> bool:
    """Whether an engine of this layout fuses the shared expert: its own flag, else sglang's default."""
    forced = layout.shared_experts_fusion
    return fuses_shared_experts_by_default(shape, layout.ep) if forced is None else forced


def vocab_rows_per_shard(vocab: int, shards: int) -> int:
    """Rows of the embedding / LM head per shard, with sglang's vocabulary padding."""
    pad = _VOCAB_PADDING
    if _round_up(vocab, pad) % shards:
        pad *= shards
    return _round_up(vocab, pad) // shards


@dataclass(frozen=True)
class _Split:
    """The numbers of a layout that decide a rank's bytes, resolved for one model."""

    tp: int
    attn_tp: int
    ep: int
    fused_shared_experts: bool

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep


def engine_rank_bytes(shape: ModelShape, layout: "EngineLayout", dtype: str = "bf16") -> RankBytes:
    """Bytes every rank of an engine with this shard layout holds (all ranks hold the same count:
    sglang shards evenly, padding the vocabulary)."""
    check_shardable(shape, layout)
    b = DTYPE_BYTES[dtype]
    h = shape.hidden
    embed_shards = layout.attn_tp if layout.attn_dp > 1 else layout.tp
    first = vocab_rows_per_shard(shape.vocab, embed_shards) * h * b
    last = h * b  # final norm
    if not shape.tie_word_embeddings:
        head_shards = layout.attn_tp if layout.dp_lm_head else layout.tp
        last += vocab_rows_per_shard(shape.vocab, head_shards) * h * b
    split = _Split(layout.tp, layout.attn_tp, layout.ep, fuses_shared_experts(shape, layout))
    layers = tuple(_layer_bytes(shape, split, i, b) for i in range(shape.layers))
    return RankBytes(first=first, layers=layers, last=last)


def full_model_bytes(shape: ModelShape, dtype: str = "bf16") -> RankBytes:
    """Bytes of the unsharded HF tensors (what the broadcast baseline sends): no vocabulary
    padding, shared experts kept apart."""
    b = DTYPE_BYTES[dtype]
    h = shape.hidden
    whole = _Split(tp=1, attn_tp=1, ep=1, fused_shared_experts=False)
    last = h * b + (0 if shape.tie_word_embeddings else shape.vocab * h * b)
    layers = tuple(_layer_bytes(shape, whole, i, b) for i in range(shape.layers))
    return RankBytes(first=shape.vocab * h * b, layers=layers, last=last)


def _layer_bytes(shape: ModelShape, split: _Split, layer: int, b: int) -> int:
    h = shape.hidden
    norms = 2 * h * b  # input_layernorm, post_attention_layernorm
    p = f"model.layers.{layer}"
    attn = _mla_bytes(shape, split, b, p) if shape.kind == "mla" else _gqa_bytes(shape, split, b, p)
    if shape.is_moe_layer(layer):
        ffn = _moe_bytes(shape, split, b, p)
    else:
        ffn = _mlp_bytes(shape, f"{p}.mlp", shape.intermediate // split.tp, b)
    return norms + attn + ffn


def _linear(shape: ModelShape, module: str, rows: int, cols: int, b: int) -> int:
    """Bytes of one linear weight shard [rows, cols] named by its HF module (the first one of a
    fused layer): ``b`` per element, or FP8 (1 byte per element + a float32 scale per block)."""
    fp8 = shape.fp8
    if fp8 is None or not fp8.quantizes(f"{module}.weight", (rows, cols)):
        return rows * cols * b
    bo, bi = fp8.block
    return rows * cols + -(-rows // bo) * -(-cols // bi) * _FP32


def _gqa_bytes(shape: ModelShape, split: _Split, b: int, p: str) -> int:
    h, d = shape.hidden, shape.head_dim
    q_heads = shape.heads // split.attn_tp
    kv_heads = max(1, shape.kv_heads // split.attn_tp)  # replicated when attention TP exceeds them
    qkv_out = (q_heads + 2 * kv_heads) * d
    n = _linear(shape, f"{p}.self_attn.q_proj", qkv_out, h, b)  # qkv_proj
    n += _linear(shape, f"{p}.self_attn.o_proj", h, q_heads * d, b)
    n += 2 * d * b  # q_norm + k_norm
    if shape.attention_bias:
        n += (qkv_out + h) * b  # column bias is sharded, row bias is whole
    return n


def _mla_bytes(shape: ModelShape, split: _Split, b: int, p: str) -> int:
    h = shape.hidden
    a = f"{p}.self_attn"
    heads = shape.heads // split.attn_tp
    qk_head = shape.qk_nope_head_dim + shape.qk_rope_head_dim
    kv_a = shape.kv_lora_rank + shape.qk_rope_head_dim
    if shape.q_lora_rank:
        # fused_qkv_a_proj_with_mqa and both lora norms are replicated; q_b_proj is sharded
        n = _linear(shape, f"{a}.q_a_proj", shape.q_lora_rank + kv_a, h, b) + shape.q_lora_rank * b
        n += _linear(shape, f"{a}.q_b_proj", heads * qk_head, shape.q_lora_rank, b)
    else:  # q_proj sharded, kv_a_proj_with_mqa replicated
        n = _linear(shape, f"{a}.q_proj", heads * qk_head, h, b)
        n += _linear(shape, f"{a}.kv_a_proj_with_mqa", kv_a, h, b)
    n += shape.kv_lora_rank * b  # kv_a_layernorm
    n += _linear(shape, f"{a}.kv_b_proj", heads * (shape.qk_nope_head_dim + shape.v_head_dim),
                 shape.kv_lora_rank, b)
    n += _linear(shape, f"{a}.o_proj", h, heads * shape.v_head_dim, b)
    return n


def _mlp_bytes(shape: ModelShape, module: str, intermediate_shard: int, b: int) -> int:
    h = shape.hidden
    return (_linear(shape, f"{module}.gate_proj", 2 * intermediate_shard, h, b)  # gate_up_proj
            + _linear(shape, f"{module}.down_proj", h, intermediate_shard, b))


def _moe_bytes(shape: ModelShape, split: _Split, b: int, p: str) -> int:
    h, e = shape.hidden, shape.experts
    gate = e * h * (_FP32 if shape.router_fp32 else b)
    if shape.router_bias_fp32:
        gate += e * _FP32  # e_score_correction_bias stays fp32
    local_experts = e // split.ep
    shared = 0
    if shape.shared_experts:
        if split.fused_shared_experts:
            local_experts += shape.shared_experts  # each rank keeps the whole shared expert
        else:
            shared = _mlp_bytes(shape, f"{p}.mlp.shared_experts",
                                shape.moe_intermediate * shape.shared_experts // split.tp, b)
    experts = local_experts * _mlp_bytes(shape, f"{p}.mlp.experts.0", shape.moe_intermediate // split.moe_tp, b)
    return gate + experts + shared


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m
