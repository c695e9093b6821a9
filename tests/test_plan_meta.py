"""The cost model's bytes per engine rank equal sglang's own model, built on the meta device for
that rank, for tiny dense (Qwen3), MoE (Qwen3-MoE) and MLA (DeepSeek-V3) configs at several
TP / EP / DP-attention layouts -- and the bytes the shared model README lists for real shapes.

The meta build is p2pweights.replica.sglang_env's (stand-in parallel groups, DP attention
initialized, ServerArgs(device="cuda")), the same one the sender's replicas use.
"""
from __future__ import annotations

import json

import pytest

from conftest import require_sglang, shared_model
from p2pweights.models import load_config
from p2pweights.models.engine_layout import EngineLayout
from p2pweights.models.shapes import engine_rank_bytes, model_shape

layout = EngineLayout.parse

TINY_DENSE = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64,
    "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 16, "vocab_size": 1000, "tie_word_embeddings": False, "attention_bias": False,
    "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 256,
    "torch_dtype": "bfloat16",
}
TINY_DENSE_TIED = {**TINY_DENSE, "tie_word_embeddings": True, "vocab_size": 1030}
TINY_MOE = {
    **TINY_DENSE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": True,
}
TINY_MLA = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 64,
    "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 8,
    "num_key_value_heads": 8, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "kv_lora_rank": 16, "q_lora_rank": 32,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1,
    "topk_method": "noaux_tc", "scoring_func": "sigmoid", "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "vocab_size": 1000, "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "max_position_embeddings": 256, "hidden_act": "silu", "attention_bias": False, "torch_dtype": "bfloat16",
}
# FP8 block-quantized (models/quant.py): 1 byte per quantized weight element + a float32 scale per
# 128x128 block; shapes that the blocks tile at tp 2 (hidden and intermediate sizes multiples of 256)
TINY_MLA_FP8 = {**TINY_MLA, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
                "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 256, "kv_lora_rank": 128,
                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]}}
TINY_DENSE_FP8 = {**TINY_DENSE, "hidden_size": 256, "intermediate_size": 512, "head_dim": 128,
                  "num_attention_heads": 4, "num_key_value_heads": 2,
                  "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                          "weight_block_size": [128, 128],
                                          "modules_to_not_convert": ["model.layers.1.mlp.down_proj"]}}
TINY_MLA_NO_Q_LORA = {**TINY_MLA, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                      "q_lora_rank": None, "topk_method": "greedy", "n_group": 1}

CASES = [
    # (config, layout, engine rank)
    (TINY_DENSE, layout("tp=1"), 0),
    (TINY_DENSE, layout("tp=2"), 1),
    (TINY_DENSE, layout("tp=4"), 3),  # KV heads replicated: 2 KV heads over attention TP 4
    (TINY_DENSE, layout("tp=8"), 5),
    (TINY_DENSE, layout("tp=4,dp=2"), 2),  # attention TP 2, embedding over attention TP
    (TINY_DENSE_TIED, layout("tp=4"), 0),  # tied embeddings, vocabulary padded to 64 * 4
    (TINY_MOE, layout("tp=2"), 0),
    (TINY_MOE, layout("tp=2,ep=2"), 1),
    (TINY_MOE, layout("tp=4,ep=2"), 3),
    (TINY_MOE, layout("tp=4,ep=4,dp=2"), 2),
    (TINY_MOE, layout("tp=8,ep=8,dp=4,dp_lm_head=1"), 7),
    (TINY_MLA, layout("tp=2"), 0),
    (TINY_MLA, layout("tp=4,ep=4"), 1),
    (TINY_MLA, layout("tp=4,ep=2,dp=4"), 3),
    (TINY_MLA, layout("tp=8,ep=8,dp=2,dp_lm_head=1"), 6),
    (TINY_MLA, layout("tp=2,fused_shared_experts=1"), 1),
    (TINY_MLA, layout("tp=4,ep=4,fused_shared_experts=1"), 2),
    (TINY_MLA_NO_Q_LORA, layout("tp=2,ep=2"), 1),
    (TINY_MLA_FP8, layout("tp=2"), 1),
    (TINY_MLA_FP8, layout("tp=2,ep=2"), 0),
    (TINY_MLA_FP8, layout("tp=2,dp=2"), 1),
    (TINY_DENSE_FP8, layout("tp=2"), 0),
]


def held_bytes(model) -> int:
    """Parameter bytes of sglang's model of a rank, less FP8 attention's scalar k_scale/v_scale
    (post-processing sets them; no sender writes them, and the cost model leaves them out)."""
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if not n.endswith((".k_scale", ".v_scale")))


@pytest.fixture(scope="module")
def sglang_meta():
    """A function building sglang's model for one engine rank on the meta device
    (p2pweights.replica.sglang_env, which stands in the parallel groups)."""
    require_sglang()
    from p2pweights.replica.sglang_env import build_model, prepare

    prepare()

    def build(model_dir: str, engine: EngineLayout, rank: int):
        if engine.shared_experts_fusion is None:  # the cost model's default here: not fused
            engine = EngineLayout.from_args(dict(engine.args), disable_shared_experts_fusion=True)
        return build_model(model_dir, engine, rank, device="meta")

    return build


def _write_config(tmp_path, config) -> str:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.mark.parametrize(
    "config, engine, rank", CASES,
    ids=[f"{c['architectures'][0]}-{e.describe()}-rank{r}" + ("-tied" if c.get("tie_word_embeddings") else "")
         + ("-fp8" if c.get("quantization_config") else "") for c, e, r in CASES],
)
def test_bytes_per_engine_rank_equal_sglangs_meta_model(sglang_meta, tmp_path, config, engine, rank):
    model = sglang_meta(_write_config(tmp_path, config), engine, rank)
    assert engine_rank_bytes(model_shape(config), engine).total == held_bytes(model)


def test_qwen3_30b_a3b_tp8_ep8_rank_equals_sglangs_meta_model(sglang_meta):
    model = sglang_meta(shared_model("qwen3-30b-a3b"), layout("tp=8,ep=8"), 5)
    sglang_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sglang_bytes == 7_680_585_728
    shape = model_shape(load_config(shared_model("qwen3-30b-a3b")))
    assert engine_rank_bytes(shape, layout("tp=8,ep=8")).total == sglang_bytes


def test_deepseek_v3_tp8_ep8_dp_attention_rank_equals_sglangs_meta_model(sglang_meta):
    dp8 = layout("tp=8,ep=8,dp=8")  # attention TP 1: every rank holds whole MLA attention
    model = sglang_meta(shared_model("deepseek-v3"), dp8, 3)
    sglang_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    shape = model_shape(load_config(shared_model("deepseek-v3")))
    assert engine_rank_bytes(shape, dp8).total == sglang_bytes


@pytest.mark.parametrize("name, spec, rank", [("kimi-k2-fp8", "tp=8,ep=8,dp=8", 3), ("deepseek-v3-fp8", "tp=8,ep=8", 2)])
def test_fp8_real_shapes_rank_equals_sglangs_meta_model(sglang_meta, name, spec, rank):
    """Kimi-K2 / DeepSeek-V3 FP8: weights, float32 block scales (edge blocks included: MLA's fused
    q_a + kv_a projection has 2112 rows) and the BF16 rest, as sglang's Fp8 methods create them."""
    from p2pweights.models import resolve_model

    model = sglang_meta(resolve_model(name), layout(spec), rank)
    assert engine_rank_bytes(model_shape(load_config(name)), layout(spec)).total == held_bytes(model)
