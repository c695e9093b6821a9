"""`p2pweights plan` at scale (issue 36, item 5): Qwen3-235B-A22B and Kimi-K2 FP8 on their real
shapes, full and at 1% changed, with the sender's per-tensor host path in the model."""
from __future__ import annotations

import json

import pytest

from p2pweights.cli import main
from p2pweights.models import load_config
from p2pweights.models.checkpoint import trainer_tensors
from p2pweights.models.shapes import PlanError
from p2pweights.planner.cost import ENGINE_NIC, Links
from p2pweights.planner.host_path import SENDER_HOST_PATH, stage_tensor_counts

QWEN3_235B = ["--model", "qwen3-235b-a22b", "--trainer", "tp=4,pp=2,ep=8,gpus=128", "--engines", "8x8",
              "--engine", "tp=8,ep=8", "--nics-per-node", "8", "--nic-gbps", "50"]
KIMI_K2_FP8 = ["--model", "kimi-k2-fp8", "--trainer", "tp=8,pp=4,ep=32,gpus=256", "--engines", "16x8",
               "--engine", "tp=8,ep=8,dp=8", "--nics-per-node", "8", "--nic-gbps", "50"]


def plan(capsys, *argv):
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def plan_json(capsys, *argv):
    return json.loads(plan(capsys, *argv, "--json"))


def test_the_built_in_qwen3_235b_has_the_real_shapes():
    c = load_config("qwen3-235b-a22b")
    assert (c["num_hidden_layers"], c["hidden_size"], c["num_experts"], c["num_experts_per_tok"]) == (94, 4096, 128, 8)
    assert (c["moe_intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (
        1536, 64, 4, 128)
    assert c["vocab_size"] == 151936 and c["tie_word_embeddings"] is False


@pytest.mark.parametrize("scenario", [QWEN3_235B, KIMI_K2_FP8], ids=["qwen3-235b-a22b", "kimi-k2-fp8"])
def test_both_scenarios_plan_full_and_at_one_percent_within_the_wire_floor(capsys, scenario):
    doc = plan_json(capsys, *scenario, "--changed-fraction", "0.01")
    cost = doc["cost"]
    assert cost["bottleneck"] == ENGINE_NIC and cost["p2p_seconds"] <= 1.25 * cost["floor_seconds"]
    assert cost["seconds_by_stage"][SENDER_HOST_PATH] == pytest.approx(cost["tensors_per_sender_max"] * 5e-6)
    assert doc["links"]["host_us_per_tensor"] == 5.0 and doc["links"]["nic_gbps_per_gpu"] == 50.0
    one = doc["delta"]["updates"][0]
    assert one["changed_fraction"] == 0.01 and one["bottleneck"] in one["seconds_by_stage"]
    # the sender is still pushed every tensor at 1%: the host path does not shrink with the wire
    assert one["seconds_by_stage"][SENDER_HOST_PATH] == cost["seconds_by_stage"][SENDER_HOST_PATH]


def test_each_sender_is_pushed_its_stages_hf_tensors():
    config = load_config("qwen3-235b-a22b")
    counts = stage_tensor_counts(config, 94, 2)
    assert sum(counts) == len(trainer_tensors(config)) == 94 * (4 + 4 + 1 + 128 * 3) + 3
    assert counts == (47 * 393 + 1, 47 * 393 + 2)  # embedding on the first stage; norm and LM head on the last
    assert stage_tensor_counts(config, 94, 1) == (sum(counts),)


def test_a_thousandfold_host_cost_makes_the_host_path_the_bound_and_says_so(capsys):
    base = plan_json(capsys, *QWEN3_235B)["cost"]
    slow = plan_json(capsys, *QWEN3_235B, "--host-us-per-tensor", "5000")["cost"]
    assert slow["bottleneck"] == SENDER_HOST_PATH
    assert slow["p2p_seconds"] == pytest.approx(1000 * base["host_path_seconds"])
    assert slow["p2p_seconds"] > base["p2p_seconds"] == base["floor_seconds"]
    out = plan(capsys, *QWEN3_235B, "--host-us-per-tensor", "5000")
    assert next(line for line in out.splitlines() if line.startswith("bottleneck")).endswith(SENDER_HOST_PATH)
    assert "the sender's host path bounds it: 18,473 tensors x 5000 us" in out


def test_no_host_cost_leaves_the_stage_out(capsys):
    doc = plan_json(capsys, *QWEN3_235B, "--host-us-per-tensor", "0")
    assert SENDER_HOST_PATH not in doc["cost"]["seconds_by_stage"] and doc["cost"]["tensors_per_sender_max"] == 0
    assert "host path per tensor left out" in plan(capsys, *QWEN3_235B, "--host-us-per-tensor", "0")


def test_fewer_nics_than_gpus_share_them_and_slow_the_wire(capsys):
    full = plan_json(capsys, *QWEN3_235B)["cost"]
    half = plan_json(capsys, *QWEN3_235B, "--nics-per-node", "4")
    assert half["links"]["nic_gbps_per_gpu"] == 25.0
    assert half["cost"]["floor_seconds"] == pytest.approx(2 * full["floor_seconds"])
    assert "NICs 4 x 50 GB/s per node of 8 GPUs = 25 GB/s per GPU" in plan(capsys, *QWEN3_235B, "--nics-per-node", "4")


@pytest.mark.parametrize("kwargs, flag", [({"nics_per_node": 0}, "--nics-per-node"),
                                          ({"gpus_per_node": 0}, "--gpus-per-node"),
                                          ({"host_us_per_tensor": -1.0}, "--host-us-per-tensor")])
def test_bad_node_or_host_figures_are_refused_naming_the_flag(kwargs, flag):
    with pytest.raises(PlanError, match=flag):
        Links(**kwargs)
