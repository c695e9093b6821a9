"""``p2pweights plan --engine-kind vllm``: a vLLM engine's layout priced as the sglang split that
shards the bytes the same way, and the layouts the sender would refuse at connect refused here too,
naming the engine flag to change (no vLLM import: the layout spec and its refusals are p2pweights')."""
from __future__ import annotations

import json

import pytest

from p2pweights.cli import main

TRAINER = ["--trainer", "tp=4,pp=1,ep=8,gpus=32"]


def plan(capsys, model: str, engines: str, engine: str, kind: str) -> tuple[int, dict | str]:
    code = main(["plan", "--model", model, *TRAINER, "--engines", engines, "--engine", engine,
                 "--engine-kind", kind, "--json"])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code == 0 else out.err)


@pytest.mark.parametrize("model, engines, vllm, sglang", [
    ("qwen3-30b-a3b", "2x8", "ep=8", "tp=8,ep=8"),             # one TP group, experts over it
    ("qwen3-30b-a3b", "1x8", "tp=4,dp=2,ep=8", "dp=2,ep=8"),    # DP ranks, experts over every rank
    ("qwen3-4b", "2x4", "tp=4", "tp=4"),
])
def test_a_vllm_engine_costs_what_the_sglang_split_with_the_same_shards_costs(capsys, model, engines, vllm, sglang):
    code, got = plan(capsys, model, engines, vllm, "vllm")
    assert code == 0, got
    code, want = plan(capsys, model, engines, sglang, "sglang")
    assert code == 0, want
    assert got["engine_kind"] == "vllm" and want["engine_kind"] == "sglang"
    assert got["engines"] == want["engines"] and got["cost"] == want["cost"] and got["senders"] == want["senders"]


@pytest.mark.parametrize("model, engines, engine, says", [
    ("qwen3-30b-a3b", "1x8", "dp=2", "--engines 2x4 --engine tp=4"),
    ("qwen3-30b-a3b", "1x8", "tp=4", "G = tp x dp"),
    ("qwen3-30b-a3b", "1x8", "ep=8,moe_backend=flashinfer_cutlass", "--moe-backend triton"),
    ("deepseek-v3-fp8", "1x16", "ep=16,flashinfer=0", "DeepGEMM's MoE"),
    ("qwen3-30b-a3b", "1x8", "ep=3", "spans every rank"),
])
def test_a_layout_the_sender_would_refuse_is_refused_naming_the_fix(capsys, model, engines, engine, says):
    code, err = plan(capsys, model, engines, engine, "vllm")
    assert code == 2 and says in err, err


def test_an_fp8_engine_with_vllms_default_kernels_is_planned(capsys):
    """DeepGEMM linears and FlashInfer CUTLASS experts: their post-processing is replayed on send."""
    code, got = plan(capsys, "deepseek-v3-fp8", "2x16", "ep=16", "vllm")
    assert code == 0, got
    assert got["engines"][0]["layout"] == "tp=16,ep=16" and got["cost"]


def test_an_fp8_engine_without_deep_gemm_and_with_triton_experts_is_planned(capsys):
    code, got = plan(capsys, "deepseek-v3-fp8", "2x16", "ep=16,deep_gemm=0,moe_backend=triton", "vllm")
    assert code == 0, got
    assert got["engines"][0]["layout"] == "tp=16,ep=16" and got["cost"]
