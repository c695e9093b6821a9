"""FP8 block-quantized engines, the replica side: the engine's checkpoint view, replicas and
check-layout byte-exact on FP8 layouts (weights and float32 scales compared), Hopper's
post-processing reproduced (DeepSeek's w_kc/w_vc, attention k_scale/v_scale), and the refusals
(a block that does not tile a shard, a quantization p2pweights cannot write)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import require_sglang
from p2pweights.cli import main
from p2pweights.errors import UnsupportedLayout
from p2pweights.models import load_config, resolve_model
from p2pweights.models.checkpoint import RandomCheckpoint, TensorSpec, checkpoint_tensors, random_tensor, trainer_tensors
from p2pweights.models.engine_layout import EngineLayout
from p2pweights.models.fp8_format import dequantize_block_fp8, quantize_block_fp8
from p2pweights.models.quant import quant_scheme

require_sglang()

TINY = "deepseek-v3-fp8-tiny"
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# Kimi-K2's structure (public config: 1 dense layer, n_group 1, topk_group 1, no MTP, yarn rope), tiny
KIMI_TINY = {
    **load_config("kimi-k2-fp8"), "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 256,
    "kv_lora_rank": 256, "n_routed_experts": 8, "num_experts_per_tok": 2, "vocab_size": 1000,
}
QWEN3_TINY = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
    "head_dim": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500,
    "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0, "max_position_embeddings": 256, "torch_dtype": "bfloat16",
    # layer 1's down_proj stays BF16 (Qwen3 FP8 checkpoints list lm_head the same way)
    "quantization_config": {**FP8, "modules_to_not_convert": ["lm_head", "model.layers.1.mlp.down_proj"]},
}


def write(tmp_path, config: dict, name: str = "model") -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def check_layout_json(capsys, model: str, engine: str) -> dict:
    rc = main(["check-layout", "--model", model, "--engine", engine, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == (0 if out["equal"] else 1)
    return out


# -- the engine's checkpoint and the trainer's tensors ---------------------------------------------------
def test_the_engines_checkpoint_is_fp8_with_scales_and_the_trainers_is_bf16():
    engine, trainer = checkpoint_tensors(TINY), trainer_tensors(TINY)
    attn = "model.layers.0.self_attn"
    for w in (f"{attn}.q_a_proj.weight", f"{attn}.kv_a_proj_with_mqa.weight", f"{attn}.kv_b_proj.weight",
              "model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"):
        assert engine[w].dtype == "float8_e4m3fn" and trainer[w].dtype == "bfloat16"
        rows, cols = engine[w].shape
        assert engine[w + "_scale_inv"] == TensorSpec((-(-rows // 128), -(-cols // 128)), "float32")
        assert w + "_scale_inv" not in trainer
    for plain in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                  "model.layers.2.eh_proj.weight", f"{attn}.kv_a_layernorm.weight"):
        assert engine[plain] == trainer[plain] and plain + "_scale_inv" not in engine
    assert [n for n in engine if not n.endswith("_scale_inv")] == list(trainer)  # same names, same order
    assert checkpoint_tensors("deepseek-v3") == trainer_tensors("deepseek-v3")  # unquantized: one view


def test_random_fp8_inputs_are_the_senders_quantization_of_seeded_bf16():
    specs, scheme = checkpoint_tensors(TINY), quant_scheme(load_config(TINY))
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    source = RandomCheckpoint(specs, 7, scheme)
    q, scale = quantize_block_fp8(random_tensor(name, trainer_tensors(TINY)[name], 7), (128, 128))
    assert torch.equal(source.tensor(name).view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(source.tensor(name + "_scale_inv"), scale)
    assert not torch.equal(RandomCheckpoint(specs, 8, scheme).tensor(name + "_scale_inv"), scale)
    with pytest.raises(ValueError, match="quant_scheme"):
        RandomCheckpoint(specs, 7).tensor(name)


# -- check-layout byte-exact ----------------------------------------------------------------------------
@pytest.mark.parametrize("model, engine", [(TINY, "tp=2,ep=2"), (TINY, "tp=2"), ("kimi", "tp=2,ep=2"),
                                           ("qwen3", "tp=2")])
def test_check_layout_is_byte_exact_on_fp8_layouts_comparing_weights_and_scales(tmp_path, capsys, model, engine):
    path = {"kimi": lambda: write(tmp_path, KIMI_TINY), "qwen3": lambda: write(tmp_path, QWEN3_TINY)}.get(
        model, lambda: model)()
    out = check_layout_json(capsys, path, engine)
    assert out["equal"] is True and out["mismatches"] == []
    # a float32 scale per FP8 weight (and DeepSeek's float32 router bias)
    assert out["dtypes"]["float8_e4m3fn"] > 0 and out["dtypes"]["float32"] >= out["dtypes"]["float8_e4m3fn"]
    assert out["dtypes"]["bfloat16"] > 0 and sum(out["dtypes"].values()) == out["params_checked"]
    for rank in out["ranks"]:
        assert rank["equal"] and rank["dtypes"]["float8_e4m3fn"] > 0 and rank["dtypes"]["float32"] > 0
        # DeepSeek's attention k_scale/v_scale: set by post-processing, written by no group, listed
        assert bool(rank["post_processed"]) is (model != "qwen3")
        assert all(n.endswith(("k_scale", "v_scale")) for n in rank["post_processed"])


def test_ignored_layers_stay_bf16_in_both_paths(tmp_path):
    from p2pweights.replica.check import check_rank
    from p2pweights.replica.model_replica import ModelReplicas

    config = write(tmp_path, QWEN3_TINY)
    assert "model.layers.1.mlp.down_proj.weight_scale_inv" not in checkpoint_tensors(config)
    replicas = ModelReplicas(cache_dir="")
    replica = replicas.get(config, EngineLayout.parse("tp=2"), 1)
    assert replica.param_specs["model.layers.1.mlp.down_proj.weight"].dtype == "bfloat16"
    assert "model.layers.1.mlp.down_proj.weight_scale_inv" not in replica.param_specs
    assert replica.param_specs["model.layers.0.mlp.down_proj.weight"].dtype == "float8_e4m3fn"
    assert replica.param_specs["model.layers.1.mlp.gate_up_proj.weight"].dtype == "float8_e4m3fn"
    result = check_rank(config, EngineLayout.parse("tp=2"), 1, replicas=replicas)  # sglang's loader agrees
    assert result.equal, result.mismatches


def test_a_weight_and_its_scale_are_one_parameter_group():
    from p2pweights.replica.model_replica import ModelReplicas

    replica = ModelReplicas(cache_dir="").get(resolve_model(TINY), EngineLayout.parse("tp=2,ep=2"), 1)
    scales = [n for n in replica.hf_specs if n.endswith(".weight_scale_inv") and replica.group_of(n) is not None]
    assert len(scales) > 20
    for scale in scales:
        assert replica.group_of(scale) is replica.group_of(scale.removesuffix("_scale_inv")), scale


def test_a_flipped_byte_in_a_scale_makes_the_check_unequal():
    from p2pweights.replica.check import compare_with_reference
    from p2pweights.replica.model_replica import ModelReplicas
    from p2pweights.replica.reference import reference_model

    config, engine = resolve_model(TINY), EngineLayout.parse("tp=2,ep=2")
    replica = ModelReplicas(cache_dir="").get(config, engine, 0)
    reference = reference_model(config, engine, 0, seed=3)
    assert compare_with_reference(replica, reference, seed=3).equal
    scale = "model.layers.1.mlp.experts.w2_weight_scale_inv"
    dict(reference.named_parameters())[scale].data.view(-1).view(torch.uint8)[5] ^= 0x01
    result = compare_with_reference(replica, reference, seed=3)
    assert not result.equal and [m.split(":")[0] for m in result.mismatches] == [scale]


# -- post-processing as on Hopper ------------------------------------------------------------------------
def _live_rank(config, engine, rank, seed):
    """An engine rank as the receiver holds it: every group written from the replica path's slot,
    then the update session's hooks (restore, post_load_weights, process_weights_after_loading)."""
    from p2pweights.replica import sglang_env
    from p2pweights.replica.model_replica import ModelReplicas

    replica = ModelReplicas(cache_dir="").get(config, engine, rank)
    live = sglang_env.materialize(sglang_env.build_model(config, engine, rank), "cpu")
    params = dict(live.named_parameters())
    source = RandomCheckpoint(replica.hf_specs, seed, quant_scheme(load_config(config)))
    slot = torch.zeros(replica.largest_group_nbytes, dtype=torch.uint8)
    for group in replica.groups:
        for r in replica.load_group(group, {n: source.tensor(n) for n in group.hf_names}, slot):
            params[r.param_name].data.reshape(-1).view(torch.uint8).copy_(slot[r.offset:r.offset + r.nbytes])
    sglang_env.run_update_session_hooks(live)
    return live


def test_the_equality_check_matches_hopper_post_processing_w_kc_w_vc_and_kv_scales(monkeypatch):
    from p2pweights.replica.reference import ReferenceModel, reference_model

    config, engine = resolve_model(TINY), EngineLayout.parse("tp=2,ep=2")
    live = _live_rank(config, engine, 1, seed=5)
    result = ReferenceModel(config, engine, 1).compare(live, seed=5)
    assert result.equal, result.mismatches
    attn = live.model.layers[0].self_attn
    # Hopper's branch: w_kc/w_vc are kv_b_proj dequantized to bf16 (block_quant_dequant), then split
    assert attn.w_kc.dtype == torch.bfloat16 and attn.w_vc.dtype == torch.bfloat16
    w = dequantize_block_fp8(attn.kv_b_proj.weight, attn.kv_b_proj.weight_scale_inv).to(torch.bfloat16)
    w_kc, w_vc = w.unflatten(0, (-1, attn.qk_nope_head_dim + attn.v_head_dim)).split(
        [attn.qk_nope_head_dim, attn.v_head_dim], dim=1)
    assert torch.equal(attn.w_kc, w_kc) and torch.equal(attn.w_vc, w_vc.transpose(1, 2))
    assert float(attn.attn_mqa.k_scale) == 1.0 == float(attn.attn_mha.v_scale)  # set by post-processing
    # without the Hopper branch (sglang's CPU one: a per-tensor requantization) the check would fail
    import sglang.srt.models.deepseek_common.deepseek_weight_loader as deepseek_loader

    monkeypatch.setattr(deepseek_loader, "_is_cuda", False)
    cpu_branch = reference_model(config, engine, 1, seed=5, post_process=True)
    assert cpu_branch.model.layers[0].self_attn.w_kc.dtype == torch.float8_e4m3fn


def test_post_processing_keeps_every_fp8_weight_and_scale_byte():
    from p2pweights.replica import sglang_env
    from p2pweights.replica.reference import reference_model, tensor_bytes

    model = reference_model(resolve_model(TINY), EngineLayout.parse("tp=2"), 0, seed=2)
    before = {n: (p, tensor_bytes(p).clone()) for n, p in model.named_parameters()}
    sglang_env.run_update_session_hooks(model)
    after = dict(model.named_parameters())
    changed = [n for n, (p, b) in before.items() if after[n] is not p or not torch.equal(tensor_bytes(after[n]), b)]
    assert changed and all(n.endswith(("k_scale", "v_scale")) for n in changed), changed


# -- refusals -------------------------------------------------------------------------------------------
def test_a_block_that_does_not_divide_a_tp_shard_is_refused_naming_the_parameter(capsys):
    from p2pweights.replica.model_replica import ModelReplicas

    with pytest.raises(UnsupportedLayout) as caught:  # q_b_proj: 4 heads x 192 rows over tp=4 = 192 rows
        ModelReplicas(cache_dir="").get(resolve_model(TINY), EngineLayout.parse("tp=4"), 1)
    e = caught.value
    assert e.parameter == "model.layers.0.self_attn.q_b_proj.weight" and e.rank == 1
    assert "rows 192 of 768" in str(e) and "128x128" in str(e)
    assert main(["check-layout", "--model", TINY, "--engine", "tp=4", "--rank", "0"]) == 1
    assert "q_b_proj.weight" in capsys.readouterr().err


def test_a_block_that_does_not_divide_an_expert_shard_is_refused_naming_the_parameter(tmp_path):
    from p2pweights.replica.model_replica import ModelReplicas

    config = write(tmp_path, {**KIMI_TINY, "moe_intermediate_size": 128})  # 64 rows per expert at moe_tp 2
    with pytest.raises(UnsupportedLayout) as caught:
        ModelReplicas(cache_dir="").get(config, EngineLayout.parse("tp=2"), 0)
    assert caught.value.parameter == "model.layers.1.mlp.experts.w13_weight"
    assert "64" in str(caught.value) and "moe_tp=2" in str(caught.value)


def test_an_unsupported_quant_method_is_one_line_exit_2(tmp_path, capsys):
    config = write(tmp_path, {**QWEN3_TINY, "quantization_config": {"quant_method": "awq", "bits": 4}})
    assert main(["check-layout", "--model", config, "--engine", "tp=1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "quant_method='awq' is not supported" in err
    assert "Traceback" not in err


def test_the_quantization_flag_must_be_the_checkpoints_own(tmp_path):
    from p2pweights.replica import sglang_env

    with pytest.raises(UnsupportedLayout, match="quantization='awq'"):
        EngineLayout.parse("tp=1,quantization=awq")
    bf16 = write(tmp_path, {k: v for k, v in QWEN3_TINY.items() if k != "quantization_config"})
    with pytest.raises(UnsupportedLayout, match="quantization='fp8' over a BF16 checkpoint"):
        sglang_env.build_model(bf16, EngineLayout.parse("tp=1,quantization=fp8"), 0)
    model = sglang_env.build_model(write(tmp_path, QWEN3_TINY, "fp8"), EngineLayout.parse("tp=1,quantization=fp8"), 0)
    assert dict(model.named_parameters())["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.float8_e4m3fn


def test_plan_refuses_a_layout_whose_shards_the_block_does_not_divide():
    from p2pweights.models.shapes import PlanError, engine_rank_bytes, model_shape

    with pytest.raises(PlanError, match="FP8 block 128x128 does not divide the q_b_proj rows of each shard"):
        engine_rank_bytes(model_shape(load_config(TINY)), EngineLayout.parse("tp=4"))


def test_built_in_fp8_configs_are_the_public_shapes():
    ds, kimi = load_config("deepseek-v3-fp8"), load_config("kimi-k2-fp8")
    assert {k: v for k, v in ds.items() if k != "quantization_config"} == load_config("deepseek-v3")
    for config in (ds, kimi):
        assert config["quantization_config"]["weight_block_size"] == [128, 128]
        assert config["quantization_config"]["activation_scheme"] == "dynamic"
    assert (kimi["num_hidden_layers"], kimi["hidden_size"], kimi["n_routed_experts"], kimi["num_attention_heads"],
            kimi["first_k_dense_replace"], kimi["n_group"], kimi["topk_group"], kimi["vocab_size"]) == (
        61, 7168, 384, 64, 1, 1, 1, 163840)
    tiny = load_config(TINY)
    assert tiny["hidden_size"] % 256 == 0 and tiny["intermediate_size"] % 256 == 0
    assert os.path.isfile(os.path.join(resolve_model(TINY), "config.json"))
