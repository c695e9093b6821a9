"""The HF checkpoint schema of each architecture: every tensor's name and shape, from config.json.

Names follow the published checkpoints (per-expert tensors, ``gate_proj``/``up_proj`` separate,
MTP layers after the decoder layers), which is what sglang's ``load_weights`` and a trainer's HF
export both speak. Each schema is a generator of (name, shape, dtype override or None); the
model registry (registry.py) says which architecture uses which.
"""
from __future__ import annotations

from typing import Callable, Iterator

Entry = tuple[str, tuple[int, ...], "str | None"]


def _head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def _gated_mlp(prefix: str, hidden: int, inter: int) -> Iterator[Entry]:
    yield f"{prefix}.gate_proj.weight", (inter, hidden), None
    yield f"{prefix}.up_proj.weight", (inter, hidden), None
    yield f"{prefix}.down_proj.weight", (hidden, inter), None


def _gqa_attention(prefix: str, cfg: dict, *, bias: bool, qk_norm: bool) -> Iterator[Entry]:
    h, d = cfg["hidden_size"], _head_dim(cfg)
    nq, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    for proj, rows in (("q_proj", nq * d), ("k_proj", nkv * d), ("v_proj", nkv * d)):
        yield f"{prefix}.{proj}.weight", (rows, h), None
        if bias:
            yield f"{prefix}.{proj}.bias", (rows,), None
    yield f"{prefix}.o_proj.weight", (h, nq * d), None
    if qk_norm:
        yield f"{prefix}.q_norm.weight", (d,), None
        yield f"{prefix}.k_norm.weight", (d,), None


def _mla_attention(prefix: str, cfg: dict) -> Iterator[Entry]:
    h, nh = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg.get("q_lora_rank"), cfg["kv_lora_rank"]
    if q_lora:
        yield f"{prefix}.q_a_proj.weight", (q_lora, h), None
        yield f"{prefix}.q_a_layernorm.weight", (q_lora,), None
        yield f"{prefix}.q_b_proj.weight", (nh * (nope + rope), q_lora), None
    else:
        yield f"{prefix}.q_proj.weight", (nh * (nope + rope), h), None
    yield f"{prefix}.kv_a_proj_with_mqa.weight", (kv_lora + rope, h), None
    yield f"{prefix}.kv_a_layernorm.weight", (kv_lora,), None
    yield f"{prefix}.kv_b_proj.weight", (nh * (nope + v), kv_lora), None
    yield f"{prefix}.o_proj.weight", (h, nh * v), None


def _routed_moe(prefix: str, cfg: dict, n_experts: int, *, score_bias: bool, n_shared: int) -> Iterator[Entry]:
    h, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    yield f"{prefix}.gate.weight", (n_experts, h), None
    if score_bias:
        yield f"{prefix}.gate.e_score_correction_bias", (n_experts,), "float32"
    for e in range(n_experts):
        yield from _gated_mlp(f"{prefix}.experts.{e}", h, inter)
    if n_shared:
        yield from _gated_mlp(f"{prefix}.shared_experts", h, inter * n_shared)


def _norms(prefix: str, h: int) -> Iterator[Entry]:
    yield f"{prefix}.input_layernorm.weight", (h,), None
    yield f"{prefix}.post_attention_layernorm.weight", (h,), None


EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


def tied_names(cfg: dict) -> dict[str, str]:
    """HF name -> the HF name whose tensor it shares: with ``tie_word_embeddings`` the LM head is
    the embedding, and the checkpoint holds only the embedding."""
    return {LM_HEAD: EMBEDDING} if cfg.get("tie_word_embeddings", False) else {}


def _embed_and_head(cfg: dict) -> Iterator[Entry]:
    yield EMBEDDING, (cfg["vocab_size"], cfg["hidden_size"]), None
    yield "model.norm.weight", (cfg["hidden_size"],), None
    if LM_HEAD not in tied_names(cfg):
        yield LM_HEAD, (cfg["vocab_size"], cfg["hidden_size"]), None


def _qwen_dense(cfg: dict, *, bias: bool, qk_norm: bool) -> Iterator[Entry]:
    h = cfg["hidden_size"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from _gqa_attention(f"{p}.self_attn", cfg, bias=bias, qk_norm=qk_norm)
        yield from _gated_mlp(f"{p}.mlp", h, cfg["intermediate_size"])
        yield from _norms(p, h)
    yield from _embed_and_head(cfg)


def qwen2(cfg: dict) -> Iterator[Entry]:
    return _qwen_dense(cfg, bias=True, qk_norm=False)


def qwen3(cfg: dict) -> Iterator[Entry]:
    return _qwen_dense(cfg, bias=bool(cfg.get("attention_bias", False)), qk_norm=True)


def qwen3_moe(cfg: dict) -> Iterator[Entry]:
    h = cfg["hidden_size"]
    step = cfg.get("decoder_sparse_step", 1) or 1
    dense_layers = set(cfg.get("mlp_only_layers") or [])
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        yield from _gqa_attention(f"{p}.self_attn", cfg, bias=bool(cfg.get("attention_bias", False)), qk_norm=True)
        if i not in dense_layers and cfg["num_experts"] > 0 and (i + 1) % step == 0:
            yield from _routed_moe(f"{p}.mlp", cfg, cfg["num_experts"], score_bias=False, n_shared=0)
        else:
            yield from _gated_mlp(f"{p}.mlp", h, cfg["intermediate_size"])
        yield from _norms(p, h)
    yield from _embed_and_head(cfg)
    # MTP layer (Qwen3-Next style, what sglang's Qwen3MoeForCausalLMMTP reads): its own decoder layer
    # (layer 0 of a one-layer model), fc over [embedding; hidden], norms; embedding and head are shared
    if cfg.get("num_nextn_predict_layers") or cfg.get("mtp_num_hidden_layers"):
        yield "mtp.fc.weight", (h, 2 * h), None
        yield "mtp.pre_fc_norm_embedding.weight", (h,), None
        yield "mtp.pre_fc_norm_hidden.weight", (h,), None
        p = "mtp.layers.0"
        yield from _gqa_attention(f"{p}.self_attn", cfg, bias=bool(cfg.get("attention_bias", False)), qk_norm=True)
        if 0 not in dense_layers and cfg["num_experts"] > 0 and 1 % step == 0:
            yield from _routed_moe(f"{p}.mlp", cfg, cfg["num_experts"], score_bias=False, n_shared=0)
        else:
            yield from _gated_mlp(f"{p}.mlp", h, cfg["intermediate_size"])
        yield from _norms(p, h)
        yield "mtp.norm.weight", (h,), None


def _deepseek_style(cfg: dict, attention: Callable[[str, dict], Iterator[Entry]]) -> Iterator[Entry]:
    """DeepSeek-V3 / GLM-4.5 family: first_k_dense_replace dense layers, then routed MoE with
    shared experts and a score-correction bias; MTP layers (if any) follow the decoder layers."""
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    first_dense = cfg.get("first_k_dense_replace", 0)
    freq = cfg.get("moe_layer_freq", 1) or 1
    score_bias = cfg.get("topk_method", "noaux_tc") == "noaux_tc"
    n_mtp = cfg.get("num_nextn_predict_layers", 0) or 0

    def layer(i: int) -> Iterator[Entry]:
        p = f"model.layers.{i}"
        yield from attention(f"{p}.self_attn", cfg)
        if cfg.get("n_routed_experts") and i >= first_dense and i % freq == 0:
            yield from _routed_moe(f"{p}.mlp", cfg, cfg["n_routed_experts"], score_bias=score_bias,
                                   n_shared=cfg.get("n_shared_experts") or 0)
        else:
            yield from _gated_mlp(f"{p}.mlp", h, cfg["intermediate_size"])
        yield from _norms(p, h)

    for i in range(n_layers):
        yield from layer(i)
    yield from _embed_and_head(cfg)
    for i in range(n_layers, n_layers + n_mtp):
        p = f"model.layers.{i}"
        yield from layer(i)
        yield f"{p}.embed_tokens.weight", (cfg["vocab_size"], h), None
        yield f"{p}.enorm.weight", (h,), None
        yield f"{p}.hnorm.weight", (h,), None
        yield f"{p}.eh_proj.weight", (h, 2 * h), None
        yield f"{p}.shared_head.norm.weight", (h,), None
        yield f"{p}.shared_head.head.weight", (cfg["vocab_size"], h), None


def deepseek_v3(cfg: dict) -> Iterator[Entry]:
    return _deepseek_style(cfg, _mla_attention)


def glm4_moe(cfg: dict) -> Iterator[Entry]:
    def attention(prefix: str, c: dict) -> Iterator[Entry]:
        return _gqa_attention(prefix, c, bias=bool(c.get("attention_bias", False)), qk_norm=bool(c.get("use_qk_norm", False)))

    return _deepseek_style(cfg, attention)
