"""The cost model: bytes per engine rank for real shapes, and the predictions built on them."""
from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import BENCH_MODELS, shared_model
from p2pweights.commands.plan import parse_engines
from p2pweights.models import load_config
from p2pweights.models.engine_layout import EngineLayout
from p2pweights.models.shapes import (
    PlanError,
    engine_rank_bytes,
    full_model_bytes,
    fuses_shared_experts_by_default,
    model_shape,
    vocab_rows_per_shard,
)
from p2pweights.planner.assign import Engine, TrainerLayout, make_plan
from p2pweights.planner.cost import (
    ENGINE_NIC,
    PRODUCTION_GBPS,
    SENDER_HOST_COPY,
    SENDER_NIC,
    SENDER_PRODUCTION,
    TRAINER_GATHER,
    Links,
    predict,
)

layout = EngineLayout.parse


def shape_of(name: str):
    folder = str(BENCH_MODELS / name) if name in ("qwen3-235b-a22b", "kimi-k2") else shared_model(name)
    return model_shape(load_config(folder))


@pytest.mark.parametrize(
    "model, engine, gigabytes",
    [  # the table of shared/models/README.md, measured on sglang's meta models
        ("qwen3-0.6b", layout("tp=1"), 1.192),
        ("qwen3-4b", layout("tp=2"), 4.023),
        ("qwen3-30b-a3b", layout("tp=8,ep=8"), 7.681),
        ("deepseek-v3", layout("tp=8,ep=8"), 169.561),
    ],
)
def test_bytes_per_engine_rank_match_the_shared_models_table(model, engine, gigabytes):
    assert round(engine_rank_bytes(shape_of(model), engine).total / 1e9, 3) == gigabytes


@pytest.mark.parametrize(
    "model, params",
    [("qwen3-235b-a22b", 235.09e9), ("kimi-k2", 1026.41e9), ("deepseek-v3", 671.03e9), ("qwen3-30b-a3b", 30.53e9)],
)
def test_full_model_has_its_published_parameter_count(model, params):
    assert full_model_bytes(shape_of(model)).total / 2 == pytest.approx(params, rel=1e-4)


def test_vocabulary_padding_follows_sglang():
    assert vocab_rows_per_shard(151936, 8) == 151936 // 8  # 151936 is a multiple of 64 * 8
    assert vocab_rows_per_shard(1000, 1) == 1024  # padded to 64
    assert vocab_rows_per_shard(1000, 2) == 512
    assert vocab_rows_per_shard(1030, 4) == 1088 // 4
    assert vocab_rows_per_shard(1030, 3) == 1152 // 3  # 1088 does not split in 3: pad to 64 * 3


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    shape = shape_of("qwen3-235b-a22b")  # 4 KV heads
    tp4, tp32 = (engine_rank_bytes(shape, layout(f"tp={t},ep={t}")) for t in (4, 32))
    # one KV head per rank from TP4 on: K and V projections stop shrinking
    kv_bytes = 2 * 128 * 4096 * 2
    q_o_tp32 = 2 * (64 // 32) * 128 * 4096 * 2
    attn32 = tp32.layers[0] - (2 * 4096 * 2) - (2 * 128 * 2)
    experts32 = 128 // 32 * 3 * 4096 * 1536 * 2 + 128 * 4096 * 2
    assert attn32 - experts32 == q_o_tp32 + kv_bytes
    assert tp4.total > tp32.total


def test_dp_attention_shards_attention_over_tp_over_dp():
    shape = shape_of("deepseek-v3")
    plain = engine_rank_bytes(shape, layout("tp=8,ep=8"))
    dp8 = engine_rank_bytes(shape, layout("tp=8,ep=8,dp=8"))  # attention TP 1: whole attention
    assert dp8.layers[10] > plain.layers[10]
    assert dp8.first == 129280 * 7168 * 2  # embedding whole: sharded over attention TP 1
    assert dp8.last == plain.last  # LM head still over full TP without dp_lm_head


def test_shared_expert_fusion_default_is_sglangs():
    assert fuses_shared_experts_by_default(shape_of("deepseek-v3"), ep=1)
    assert not fuses_shared_experts_by_default(shape_of("deepseek-v3"), ep=8)
    assert not fuses_shared_experts_by_default(shape_of("kimi-k2"), ep=1)  # 384 experts: only quark


def test_engine_layout_errors_name_the_flag():
    with pytest.raises(PlanError, match="--engine: ep=3 must divide tp=8"):
        parse_engines("1x8", "ep=3", shape_of("qwen3-30b-a3b"))
    with pytest.raises(PlanError, match="--engine: ep=2 on a dense model"):
        engine_rank_bytes(shape_of("qwen3-4b"), layout("tp=2,ep=2"))
    with pytest.raises(PlanError, match="--engine: attention TP 3 .* does not divide the 16 attention heads"):
        engine_rank_bytes(shape_of("qwen3-0.6b"), layout("tp=3"))
    odd_kv = dataclasses.replace(shape_of("qwen3-0.6b"), heads=12, kv_heads=6)
    with pytest.raises(PlanError, match="--engine: attention TP 4 and the 6 KV heads"):
        engine_rank_bytes(odd_kv, layout("tp=4"))


def plan_for(model, trainer, engines, ep_equals_tp=True):
    shape = shape_of(model)
    layouts = [Engine(g, layout(f"tp={g},ep={g if ep_equals_tp else 1}")) for g in engines]
    return shape, make_plan(trainer, layouts, shape)


@settings(max_examples=60, deadline=None)
@given(
    pp=st.sampled_from([1, 2, 4, 8]),
    dp=st.integers(1, 16),
    engines=st.lists(st.sampled_from([4, 8, 16, 32]), min_size=1, max_size=6),
    host_slots=st.booleans(),
)
def test_p2p_never_beats_the_wire_floor_and_names_its_bottleneck(pp, dp, engines, host_slots):
    shape, plan = plan_for("qwen3-235b-a22b", TrainerLayout(gpus=pp * dp * 4, tp=4, pp=pp), engines)
    cost = predict(plan, shape, Links(host_slots=host_slots))
    assert cost.p2p_seconds >= cost.floor_seconds
    assert cost.p2p_seconds == dict(cost.seconds_by_link)[cost.bottleneck]
    assert (SENDER_HOST_COPY in dict(cost.seconds_by_link)) == host_slots
    assert cost.broadcast_seconds == pytest.approx(full_model_bytes(shape).total / 50e9)
    # a sender writes what it prepares at least once
    assert cost.bytes_per_sender_max >= cost.bytes_prepared_per_sender_max


def test_stage_bytes_add_up_to_the_engine_rank():
    shape = shape_of("deepseek-v3")
    rank = engine_rank_bytes(shape, layout("tp=32,ep=32"))
    _, plan = plan_for("deepseek-v3", TrainerLayout(gpus=256, tp=8, pp=4, ep=32), [32] * 8)
    stages = plan.stage_bounds
    total = sum(rank.of_layers(s, e, first=i == 0, last=i == len(stages) - 1) for i, (s, e) in enumerate(stages))
    assert total == rank.total


def test_one_sender_per_engine_rank_is_engine_nic_bound():
    # 64 senders, 8 engines of 8 ranks: no fan-out, sender and engine carry the same bytes
    shape, plan = plan_for("qwen3-30b-a3b", TrainerLayout(gpus=64, pp=1), [8] * 8)
    cost = predict(plan, shape, Links(host_slots=False))
    assert cost.bottleneck == ENGINE_NIC and cost.p2p_seconds == cost.floor_seconds


def test_few_senders_fanning_out_are_sender_nic_bound():
    shape, plan = plan_for("qwen3-30b-a3b", TrainerLayout(gpus=8, tp=8), [8] * 8)
    cost = predict(plan, shape, Links())
    assert plan.max_engines_per_sender == 8
    assert cost.bottleneck == SENDER_NIC
    assert cost.p2p_seconds == pytest.approx(8 * cost.floor_seconds)


def test_slow_host_copies_become_the_bottleneck():
    shape, plan = plan_for("qwen3-30b-a3b", TrainerLayout(gpus=8, tp=8), [8])
    cost = predict(plan, shape, Links(host_device_gbps=5))
    assert cost.bottleneck == SENDER_HOST_COPY


def test_fp8_bytes_per_engine_rank_roughly_halve_and_count_the_scales(capsys):
    from p2pweights.cli import main
    from p2pweights.models.checkpoint import checkpoint_tensors

    fp8, bf16, dp8 = model_shape(load_config("kimi-k2-fp8")), shape_of("kimi-k2"), layout("tp=8,ep=8,dp=8")
    ratio = engine_rank_bytes(fp8, dp8).total / engine_rank_bytes(bf16, dp8).total
    assert 0.5 < ratio < 0.52  # 1 byte per weight element, plus scales, plus the BF16 embeddings and norms
    # one engine rank of TP1 holds the whole engine checkpoint: FP8 weights, every float32 scale, BF16 rest
    whole = sum(spec.nbytes for spec in checkpoint_tensors("kimi-k2-fp8").values())
    assert engine_rank_bytes(fp8, layout("tp=1")).total == whole
    assert main(["plan", "--model", "kimi-k2-fp8", "--trainer", "tp=8,pp=8,ep=8,gpus=512", "--engines", "16x8",
                 "--engine", "tp=8,ep=8,dp=8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"]["quantization"]["weight_block_size"] == [128, 128]
    assert out["cost"]["bytes_per_engine_rank_max"] == engine_rank_bytes(fp8, dp8).total


def test_slow_production_is_the_bottleneck_and_fast_production_leaves_it_to_the_nic():
    # one sender per engine rank, GPU slots: only the NIC, production and gather remain
    shape, plan = plan_for("qwen3-30b-a3b", TrainerLayout(gpus=64, pp=1), [8] * 8)
    prepared = engine_rank_bytes(shape, layout("tp=8,ep=8")).total
    slow = predict(plan, shape, Links(host_slots=False, production_gbps=10))
    assert slow.bottleneck == SENDER_PRODUCTION
    assert slow.p2p_seconds == slow.production_seconds == pytest.approx(prepared / 10e9)
    fast = predict(plan, shape, Links(host_slots=False, production_gbps=1000))
    assert fast.bottleneck == ENGINE_NIC and fast.p2p_seconds == fast.floor_seconds
    # the modes' defaults: the loaders' measured rate, the replay's target
    loader = predict(plan, shape, Links(host_slots=False))
    replay = predict(plan, shape, Links(host_slots=False, production="replay"))
    assert loader.production_seconds == pytest.approx(prepared / (PRODUCTION_GBPS["loader"] * 1e9))
    assert replay.production_seconds == pytest.approx(prepared / (PRODUCTION_GBPS["replay"] * 1e9))
    assert replay.production_seconds < loader.production_seconds


def test_production_counts_each_prepared_byte_once_whatever_the_fan_out():
    shape, plan = plan_for("qwen3-30b-a3b", TrainerLayout(gpus=8, tp=8), [8] * 8)  # each sender writes 8 engines
    cost = predict(plan, shape, Links(production_gbps=1))
    assert cost.production_seconds == pytest.approx(cost.bytes_prepared_per_sender_max / 1e9)
    assert cost.bytes_per_sender_max == 8 * cost.bytes_prepared_per_sender_max
    assert cost.bottleneck == SENDER_PRODUCTION


def test_host_slots_are_bound_by_the_slower_of_production_and_the_host_copy():
    shape, plan = plan_for("qwen3-30b-a3b", TrainerLayout(gpus=64, pp=1), [8] * 8)
    staged = predict(plan, shape, Links(nic_gbps=1000, production_gbps=366, host_device_gbps=55))
    assert staged.bottleneck == SENDER_HOST_COPY  # overlapped: max, not the sum of the two
    assert staged.p2p_seconds == pytest.approx(staged.bytes_prepared_per_sender_max / 55e9)


ROUTED_QWEN3_30B = 48 * 128 * 3 * 2048 * 768 * 2  # layers x experts x (gate, up, down) x hidden x moe_inter x bf16


@pytest.mark.parametrize(
    "trainer, gathered",
    [  # (trainer layout, bytes one sender gathers as a function of the full model's bytes F)
        (TrainerLayout(gpus=4, tp=4), lambda full: full - full // 4),
        (TrainerLayout(gpus=8, tp=1, fsdp=8), lambda full: full - full // 8),
        (TrainerLayout(gpus=4, tp=2, fsdp=2), lambda full: full - full // 4),
        (TrainerLayout(gpus=1), lambda full: 0),
    ],
)
def test_gather_is_what_a_dense_rank_does_not_hold(trainer, gathered):
    shape = shape_of("qwen3-4b")
    plan = make_plan(trainer, [Engine(2, layout("tp=2"))], shape)
    cost = predict(plan, shape, Links())
    assert cost.bytes_gathered_per_sender_max == gathered(full_model_bytes(shape).total)


def test_gather_per_pp_stage_counts_the_largest_stage_and_pp_gathered_the_whole_model():
    shape = shape_of("qwen3-4b")
    full = full_model_bytes(shape)
    engines = [Engine(2, layout("tp=2"))]
    staged = make_plan(TrainerLayout(gpus=8, tp=2, pp=4), engines, shape)
    stage_full = [full.of_layers(s, e, first=i == 0, last=i == 3) for i, (s, e) in enumerate(staged.stage_bounds)]
    assert predict(staged, shape).bytes_gathered_per_sender_max == max(n - n // 2 for n in stage_full)
    gathered = make_plan(TrainerLayout(gpus=8, tp=2, pp=4, pp_gathered=True), engines, shape)
    assert predict(gathered, shape).bytes_gathered_per_sender_max == full.total - full.total // 8


def test_gather_splits_routed_experts_over_ep_and_the_rest_over_tp():
    shape = shape_of("qwen3-30b-a3b")
    full = full_model_bytes(shape).total
    engines = [Engine(8, layout("tp=8,ep=8"))]

    def gathered(trainer):
        return predict(make_plan(trainer, engines, shape), shape).bytes_gathered_per_sender_max

    # EP8 alone: a rank holds every dense byte and 1/8 of the experts
    assert gathered(TrainerLayout(gpus=8, ep=8)) == ROUTED_QWEN3_30B - ROUTED_QWEN3_30B // 8
    # TP2 with EP8 on 8 GPUs: dense bytes over TP2 as well
    dense = full - ROUTED_QWEN3_30B
    assert gathered(TrainerLayout(gpus=8, tp=2, ep=8)) == dense - dense // 2 + ROUTED_QWEN3_30B - ROUTED_QWEN3_30B // 8
    # FSDP shards the experts further, but never over more ranks than a stage has
    assert gathered(TrainerLayout(gpus=16, ep=8, fsdp=2)) == (
        dense - dense // 2 + ROUTED_QWEN3_30B - ROUTED_QWEN3_30B // 16)
    assert gathered(TrainerLayout(gpus=16, ep=16, fsdp=16)) == (
        dense - dense // 16 + ROUTED_QWEN3_30B - ROUTED_QWEN3_30B // 16)


def test_a_slow_gather_is_the_bottleneck():
    shape, plan = plan_for("qwen3-30b-a3b", TrainerLayout(gpus=64, tp=8), [8] * 8)
    cost = predict(plan, shape, Links(gather_gbps=5))
    assert cost.bottleneck == TRAINER_GATHER
    assert cost.p2p_seconds == cost.gather_seconds == pytest.approx(cost.bytes_gathered_per_sender_max / 5e9)
    assert predict(plan, shape, Links(gather_gbps=1e6)).bottleneck != TRAINER_GATHER


def test_plan_prints_and_emits_production_and_gather(capsys):
    from p2pweights.cli import main

    argv = ["plan", "--model", shared_model("qwen3-30b-a3b"), "--trainer", "tp=8,gpus=8", "--engines", "1x8",
            "--engine", "tp=8,ep=8", "--slots", "gpu"]
    assert main([*argv, "--production", "replay"]) == 0
    out = capsys.readouterr().out
    assert "production replay 1000 GB/s (target, not measured)" in out
    assert "time on sender production" in out and "time on trainer gather" in out
    assert "bytes gathered per sender (max)" in out
    assert main([*argv, "--production-gbps", "2", "--gather-gbps", "123", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["links"]["production"] == "loader" and doc["links"]["production_gbps"] == 2
    assert doc["links"]["production_measured"] is True and doc["links"]["gather_gbps"] == 123
    assert doc["cost"]["bottleneck"] == SENDER_PRODUCTION
    assert doc["cost"]["production_seconds"] == pytest.approx(doc["cost"]["bytes_prepared_per_sender_max"] / 2e9)
    assert doc["cost"]["gather_seconds"] == pytest.approx(doc["cost"]["bytes_gathered_per_sender_max"] / 123e9)
