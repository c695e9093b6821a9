"""The vLLM replica writes exactly the bytes a vLLM 0.33 engine rank holds after loading and
post-processing, for every rank and layout; layouts whose post-processing rewrites them are refused.

Each case builds vLLM's own model of every rank on meta under the Hopper stand-in (replica path:
probe, parameter groups, one slot, vLLM's loaders) and compares every parameter with vLLM's
``load_weights`` + ``process_weights_after_loading`` on a materialized CPU model of the same rank.
vLLM is imported once per module (12-60 s on the shared CPU machine); shapes are tiny.
"""
from __future__ import annotations

import json
import os
import random
import re

import pytest

try:
    import vllm  # noqa: F401  (the platform is not resolved by this import)
except ImportError as e:  # the only reason to skip: docs/vllm.md says how to install it
    pytest.skip(f"vllm is not importable ({e}); install vllm 0.33.0 as docs/vllm.md says",
                allow_module_level=True)
torch = pytest.importorskip("torch")

from p2pweights.cli import main  # noqa: E402
from p2pweights.errors import LayoutSpecError, MissingTensors, UnknownParameter, UnsupportedLayout  # noqa: E402
from p2pweights.models import load_config  # noqa: E402
from p2pweights.replica import vllm_env  # noqa: E402
from p2pweights.replica.vllm_check import check_byte_exact, check_rank  # noqa: E402
from p2pweights.replica.vllm_layout import VllmLayout, refusal  # noqa: E402
from p2pweights.replica.vllm_replica import VllmReplicas  # noqa: E402
from replica_configs import write_config  # noqa: E402

# DeepSeek-V3 needs MLA head dims vLLM's attention backends take (nope 128, rope 64, v 128): the
# built-in deepseek-v3-fp8-tiny's shapes, with and without its FP8 128x128 block quantization.
_DSV3_FP8 = load_config("deepseek-v3-fp8-tiny")
_DSV3_BF16 = {k: v for k, v in _DSV3_FP8.items() if k != "quantization_config"}
_CONFIGS = {"dsv3_fp8": _DSV3_FP8, "dsv3_bf16": _DSV3_BF16}


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    vllm_env.prepare()
    root = str(tmp_path_factory.mktemp("vllm_configs"))

    def make(name: str, **overrides):
        if name not in _CONFIGS:
            return write_config(name, root, **overrides)
        path = os.path.join(root, name + "".join(f"_{k}{v}" for k, v in sorted(overrides.items())))
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump({**_CONFIGS[name], **overrides}, f)
        return path
    return make


@pytest.fixture(scope="module")
def replicas():
    return VllmReplicas()


def _assert_byte_exact(path, layout, replicas):
    result = check_byte_exact(path, layout, replicas=replicas)
    assert result.mismatches == []
    assert [r.rank for r in result.ranks] == list(range(layout.world_size))
    for r in result.ranks:  # every parameter the engine rank holds was written by a group and compared
        replica = replicas.get(path, layout, r.rank)
        assert r.params_checked == len(replica.param_specs) - len(replica.mapping.derived) > 0
    return result


# (config, vLLM layout): TP 1/2, EP over TP and over DP x TP, DeepSeek BF16 and FP8 (128x128 blocks)
CASES = [
    ("qwen3", "tp=1"),
    ("qwen3", "tp=2"),
    ("qwen3_moe", "tp=2"),
    ("qwen3_moe", "tp=2,ep=2"),
    ("qwen3_moe", "tp=1,dp=2,ep=2"),
    ("dsv3_bf16", "tp=1"),
    ("dsv3_bf16", "tp=2,ep=2"),
    ("dsv3_fp8", "tp=2,deep_gemm=0"),
    ("dsv3_fp8", "tp=2,ep=2,deep_gemm=0,moe_backend=triton"),
]


@pytest.mark.parametrize("model,spec", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_every_parameter_of_every_rank_matches_vllms_load_and_post_processing(configs, replicas, model, spec):
    result = _assert_byte_exact(configs(model), VllmLayout.parse(spec), replicas)
    if model == "dsv3_fp8":  # the FP8 weights and their float32 block scales were compared
        assert result.dtypes.get("float8_e4m3fn", 0) > 0 and result.dtypes.get("float32", 0) > 0
    if model.startswith("dsv3"):  # derived by post-processing, written by no group
        for r in result.ranks:
            assert any(n.endswith(".W_UV") for n in r.post_processed)
            assert any(n.endswith(".W_UK_T") for n in r.post_processed)


# Held-out shapes: a layout and model size no case above names, drawn from a printed seed.
_HELD_OUT_LAYOUTS = {
    "qwen3": ["tp=4", "tp=2,dp=2"],
    "qwen3_moe": ["tp=4", "tp=4,ep=4", "tp=2,dp=2,ep=4", "tp=1,dp=4,ep=4", "tp=1,dp=2"],
    "dsv3_bf16": ["tp=4", "tp=1,dp=2,ep=2", "tp=2,dp=2,ep=4"],
}


def test_a_held_out_layout_and_size_is_byte_exact(configs, replicas):
    seed = random.SystemRandom().randrange(1 << 31)
    rng = random.Random(seed)
    model = rng.choice(sorted(_HELD_OUT_LAYOUTS))
    spec = rng.choice(_HELD_OUT_LAYOUTS[model])
    if model == "dsv3_bf16":  # routed experts divisible by EP 4; vocab 512 or 640
        sizes = {"n_routed_experts": rng.choice([4, 8]), "vocab_size": rng.choice([512, 640]),
                 "num_hidden_layers": rng.choice([2, 3])}
    else:  # hidden width, experts, depth, a vocab TP may not divide
        sizes = {"hidden_size": rng.choice([64, 128]), "vocab_size": rng.choice([250, 300, 256]),
                 "num_hidden_layers": rng.choice([1, 2, 3])}
        if model == "qwen3_moe":
            sizes["num_experts"] = rng.choice([4, 8, 16])
    print(f"held-out case (seed {seed}): {model} {spec} {sizes}")
    _assert_byte_exact(configs(model, **sizes), VllmLayout.parse(spec), replicas)


def test_post_processing_that_rewrites_the_bytes_is_caught(configs, replicas, monkeypatch):
    """The check compares with the post-processed engine rank: a kernel that swaps the w13 halves
    after loading (FlashInfer CUTLASS does) must show up as mismatches naming the experts."""
    original = vllm_env.post_process

    def swapping(model, device="cpu"):
        original(model, device)
        for name, p in model.named_parameters():
            if name.endswith("w13_weight"):
                gate, up = p.data.chunk(2, dim=1)
                p.data.copy_(torch.cat([up, gate], dim=1))
    monkeypatch.setattr(vllm_env, "post_process", swapping)
    result = check_rank(configs("qwen3_moe"), VllmLayout.parse("tp=2,ep=2"), 1, replicas=replicas)
    assert result.mismatches
    assert all("w13_weight" in m for m in result.mismatches)


def test_the_built_fp8_rank_uses_the_kernels_whose_post_processing_keeps_bytes(configs, replicas):
    layout = VllmLayout.parse("tp=2,ep=2,deep_gemm=0,moe_backend=triton")
    model = replicas.get(configs("dsv3_fp8"), layout, 0).model
    linear = {type(m.quant_method.fp8_linear).__name__ for m in model.modules()
              if getattr(getattr(m, "quant_method", None), "fp8_linear", None) is not None}
    moe = {m.quant_method.fp8_backend.name for m in model.modules()
           if getattr(getattr(m, "quant_method", None), "fp8_backend", None) is not None}
    assert linear == {"CutlassFp8BlockScaledMMKernel"} and moe == {"TRITON"}


@pytest.mark.parametrize("model,spec,names", [
    ("dsv3_fp8", "tp=2,ep=2,flashinfer=0", "--moe-backend triton"),
    ("qwen3_moe", "tp=2,moe_backend=flashinfer_cutlass", "--moe-backend triton"),
    ("qwen3_moe", "tp=2,ep=2,moe_backend=deep_gemm", "--moe-backend triton"),
], ids=["deepgemm-fp8-ep-experts", "flashinfer-bf16-experts", "deepgemm-experts"])
def test_a_layout_whose_post_processing_rewrites_bytes_is_refused_naming_the_fix(configs, capsys, model, spec, names):
    path = configs(model)
    layout = VllmLayout.parse(spec)
    assert names in refusal(load_config(path), layout)
    with pytest.raises(UnsupportedLayout, match=re.escape(names)):
        vllm_env.build_model(path, layout, 0)
    assert main(["check-layout", "--engine-kind", "vllm", "--model", path, "--engine", spec]) == 2
    assert names in capsys.readouterr().err


def test_layout_spellings_vllm_cannot_have_are_refused():
    with pytest.raises(LayoutSpecError, match="write ep=2"):
        VllmLayout.parse("tp=2,ep=3")
    with pytest.raises(LayoutSpecError, match="dp_lm_head"):
        VllmLayout.parse("tp=2,dp_lm_head=true")
    with pytest.raises(LayoutSpecError, match="moe_backend"):
        VllmLayout.parse("tp=2,moe_backend=nonsense").check_supported()
    assert VllmLayout.parse("tp=2,dp=2,ep=4").ep == 4 and VllmLayout.parse("tp=2,ep=1").ep == 1


def test_the_replica_interface_names_what_a_sender_gets_wrong(configs, replicas):
    path = configs("qwen3_moe")
    replica = replicas.get(path, VllmLayout.parse("tp=2,ep=2"), 1)
    # rank 1 of EP 2 holds experts 4..7: expert 0's tensors are another rank's, not unknown
    assert replica.group_of("model.layers.0.mlp.experts.0.down_proj.weight") is None
    assert replica.group_of("model.layers.0.mlp.experts.7.down_proj.weight") is not None
    with pytest.raises(UnknownParameter):
        replica.group_of("model.layers.0.mlp.experts.99.down_proj.weight")
    group = replica.group_of("model.layers.0.self_attn.q_proj.weight")
    slot = torch.zeros(replica.largest_group_nbytes, dtype=torch.uint8)
    with pytest.raises(MissingTensors):
        replica.load_group(group, {"model.layers.0.self_attn.q_proj.weight": torch.zeros(1)}, slot)
    assert all(p.is_meta for p in replica.model.parameters())  # nothing kept pointing into a slot


def test_check_layout_cli_reports_every_rank_as_json(configs, capsys):
    path = configs("qwen3")
    assert main(["check-layout", "--engine-kind", "vllm", "--model", path, "--engine", "tp=2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["equal"] and out["engine_kind"] == "vllm" and [r["rank"] for r in out["ranks"]] == [0, 1]
    assert out["params_checked"] == sum(r["params_checked"] for r in out["ranks"]) > 0
