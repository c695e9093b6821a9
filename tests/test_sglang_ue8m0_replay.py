"""sglang's Blackwell FP8 post-processing replayed on send (replica/sglang_ue8m0.py), each transform
named: ue8m0_requant (sglang's ``requant_weight_ue8m0``: BF16 dequant, power-of-two requantization)
and ue8m0_pack (``transform_scale_ue8m0``: scales per row, packed to int32 MN-major by DeepGEMM's
torch reference of its CUDA kernel). check-layout byte-exact against sglang's own load +
post-processing on this CPU; the engine's finish not requantizing again (its ``format_ue8m0`` gate)
while the requantization itself is not idempotent; replayed groups never copy plans; Hopper layouts
unchanged; connect taking sm100 for 128x128 float32-scale checkpoints only."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import require_sglang
from p2pweights.cli import main
from p2pweights.errors import EngineMismatch, UnsupportedLayout
from p2pweights.models import load_config, resolve_model
from p2pweights.models.checkpoint import RandomCheckpoint
from p2pweights.models.engine_layout import EngineLayout
from p2pweights.models.quant import quant_scheme
from p2pweights.replica import fp8_engine, reference, sglang_env
from p2pweights.replica.build_check import engine_identity, replica_environment
from p2pweights.replica.model_replica import BlackwellModelReplica, ModelReplicas
from p2pweights.replica.sglang_ue8m0 import TRANSFORMS, memory_bytes

require_sglang()

TINY = "deepseek-v3-fp8-tiny"
SM100 = "tp=1,gpu_arch=sm100,moe_runner_backend=deep_gemm"
ATTN = "model.layers.0.self_attn.q_b_proj"
EXPERTS = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def replica():
    return ModelReplicas(cache_dir="").get(resolve_model(TINY), EngineLayout.parse(SM100), 0)


def loaded_and_replayed(replica, module: str):
    """The loaders' bytes of ``module``'s group (a Hopper-layout replica of the same rank loads them)
    and the Blackwell replica's slot bytes of the same group."""
    config = resolve_model(TINY)
    hopper = ModelReplicas(cache_dir="").get(config, EngineLayout.parse("tp=1,moe_runner_backend=deep_gemm"), 0)
    source = RandomCheckpoint(replica.mapping.hf_specs, 0, quant_scheme(load_config(config)))
    group = next(g for g in replica.groups if any(p.startswith(module + ".") for p in g.params))
    inputs = {n: source.tensor(n) for n in group.hf_names}
    out = {}
    for r, name in ((hopper, "loaded"), (replica, "replayed")):
        g = r.groups[group.index]
        slot = torch.zeros(g.nbytes, dtype=torch.uint8)
        out[name] = {x.param_name: slot[x.offset:x.offset + x.nbytes].clone() for x in r.load_group(g, inputs, slot)}
    return out["loaded"], out["replayed"], hopper


# -- check-layout, byte-exact against sglang's load + post-processing --------------------------------
@pytest.mark.parametrize("engine", [SM100, "tp=2,ep=2,gpu_arch=sm100,moe_runner_backend=deep_gemm",
                                    "tp=2,gpu_arch=sm100,moe_runner_backend=triton"])
def test_check_layout_of_a_blackwell_engine_is_byte_exact_with_packed_int32_scales(capsys, engine):
    assert main(["check-layout", "--model", TINY, "--engine", engine, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["equal"] and not out["mismatches"], out["mismatches"]
    assert out["dtypes"]["int32"] > 0 and out["dtypes"]["float8_e4m3fn"] > 0  # packed scales and weights compared
    assert all(r["equal"] for r in out["ranks"])


def test_the_replica_names_each_replayed_module_linears_and_deepgemm_experts(replica):
    assert isinstance(replica, BlackwellModelReplica)
    assert replica.replayed[ATTN] == "+".join(TRANSFORMS) and EXPERTS in replica.replayed
    assert replica.param_specs[f"{ATTN}.weight_scale_inv"].dtype == "int32"
    assert replica.param_specs[f"{ATTN}.weight_scale_inv"].shape == (768, 1)  # one row per weight row, K/512
    assert replica.param_specs[f"{EXPERTS}.w13_weight_scale_inv"].shape == (4, 512, 1)
    assert "model.embed_tokens.weight" not in replica.replay.module_of


def test_ue8m0_requant_is_sglangs_requant_weight_ue8m0_of_the_loaded_bytes(replica):
    from sglang.srt.layers.quantization.fp8_utils import requant_weight_ue8m0

    loaded, replayed, hopper = loaded_and_replayed(replica, ATTN)
    spec_w, spec_s = (hopper.param_specs[f"{ATTN}.{a}"] for a in ("weight", "weight_scale_inv"))
    w = loaded[f"{ATTN}.weight"].view(torch.float8_e4m3fn).view(spec_w.shape)
    s = loaded[f"{ATTN}.weight_scale_inv"].view(torch.float32).view(spec_s.shape)
    with sglang_env.activate(replica.model):
        want_w, want_s = requant_weight_ue8m0(w, s, [128, 128])
    assert torch.equal(replayed[f"{ATTN}.weight"], memory_bytes(want_w))
    assert torch.equal(replayed[f"{ATTN}.weight_scale_inv"], memory_bytes(want_s))
    assert not torch.equal(replayed[f"{ATTN}.weight"], loaded[f"{ATTN}.weight"])  # the bytes were rewritten


def test_ue8m0_pack_is_mn_major_int32_that_sglangs_inverse_reads_back_as_power_of_two_scales(replica):
    from sglang.srt.layers.quantization.fp8_utils import inverse_transform_scale_ue8m0

    _, replayed, _ = loaded_and_replayed(replica, ATTN)
    n, k4 = replica.param_specs[f"{ATTN}.weight_scale_inv"].shape
    packed = replayed[f"{ATTN}.weight_scale_inv"].view(torch.int32).view(k4, n).t()  # MN-major in memory
    with sglang_env.activate(replica.model):
        scales = inverse_transform_scale_ue8m0(packed, mn=n)  # asserts it re-packs to the same int32s
    k = 256 // 128  # q_b_proj's input, in blocks; DeepGEMM pads each int32 to 4 blocks with zero bytes
    assert scales.shape == (n // 128, 4 * k4) and bool((torch.frexp(scales[:, :k])[0] == 0.5).all())
    assert not scales[:, k:].any()


def test_deepgemm_experts_are_requantized_expert_by_expert(replica):
    loaded, replayed, _ = loaded_and_replayed(replica, EXPERTS)
    assert not torch.equal(loaded[f"{EXPERTS}.w13_weight"], replayed[f"{EXPERTS}.w13_weight"])
    assert replayed[f"{EXPERTS}.w13_weight_scale_inv"].numel() == 4 * 512 * 1 * 4


# -- the engine's finish: not applied twice ----------------------------------------------------------
def test_the_engines_end_weight_update_keeps_the_post_processed_bytes_by_its_format_ue8m0_gate():
    config, engine = resolve_model(TINY), EngineLayout.parse(SM100)
    model = reference.reference_model(config, engine, 0, post_process=True)
    before = {n: memory_bytes(p).clone() for n, p in model.named_parameters()}
    assert getattr(model.get_submodule(ATTN).weight_scale_inv, "format_ue8m0", False)
    sglang_env.run_update_session_hooks(model)  # begin + end_weight_update, as the engine runs them
    after = {n: memory_bytes(p) for n, p in model.named_parameters()}
    changed = [n for n in before if "k_scale" not in n and "v_scale" not in n and not torch.equal(before[n], after[n])]
    assert not changed


def test_requantizing_again_without_the_gate_is_not_byte_idempotent_but_keeps_the_values():
    """Why the gate matters: a block whose largest FP8 magnitude is <= 224 after the first pass gets
    half its scale and doubled bytes from a second one (sglang says so in
    model_runner._gather_block_fp8_linear); every other block is unchanged. Block (0, 0) is made so:
    scale 1 + 2^-8 and largest value 224 requantize to scale 1 and largest value fp8(225) = 224."""
    from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant, inverse_transform_scale_ue8m0, requant_weight_ue8m0

    model = sglang_env.build_model(resolve_model(TINY), EngineLayout.parse(SM100), 0)

    def requant(w, s):  # sglang's pass, its packed scales read back by sglang's own inverse
        out_w, packed = requant_weight_ue8m0(w, s, [128, 128])
        return out_w, inverse_transform_scale_ue8m0(packed, mn=w.shape[0])

    g = torch.Generator().manual_seed(0)
    w = torch.randn(256, 512, generator=g) * 0.05
    s = w.abs().reshape(2, 128, 4, 128).amax(dim=(1, 3)) / 448
    s[0, 0] = 1 + 2 ** -8
    q = (w / s.repeat_interleave(128, 0).repeat_interleave(128, 1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    q[:128, :128] = torch.full((128, 128), 0.5).to(torch.float8_e4m3fn)
    q[0, 0] = 224
    with sglang_env.activate(model):
        w1, s1 = requant(q, s)
        w2, s2 = requant(w1, s1)
        small = w1.float().abs().reshape(2, 128, 4, 128).amax(dim=(1, 3)) <= 224
        assert bool(small[0, 0]) and float(s1[0, 0]) == 1.0
        assert torch.equal(s2 == s1 / 2, small) and torch.equal(s2 == s1, ~small)
        assert not torch.equal(w2.view(torch.uint8), w1.view(torch.uint8))
        assert torch.equal(w2.view(torch.uint8)[128:], w1.view(torch.uint8)[128:]) or bool(small[1].any())
        assert torch.equal(block_quant_dequant(w2, s2, [128, 128], torch.float32),
                           block_quant_dequant(w1, s1, [128, 128], torch.float32))


# -- copies, Hopper, connect -------------------------------------------------------------------------
def test_a_replayed_group_is_never_a_copy_plan(replica):
    by_param = {p: g for g in replica.groups for p in g.params}
    assert "replayed" in replica.not_a_copy(by_param[f"{ATTN}.weight"])
    assert replica.not_a_copy(by_param["model.embed_tokens.weight"]) is None


def test_hopper_layouts_are_unchanged_and_other_architectures_refused():
    assert EngineLayout.parse("tp=2,gpu_arch=sm90") == EngineLayout.parse("tp=2")
    assert EngineLayout.parse("tp=2").gpu_arch is None and "gpu_arch" not in dict(EngineLayout.parse("tp=2").args)
    assert EngineLayout.parse("tp=2,gpu_arch=sm_100a").gpu_arch == "sm100"
    assert "gpu_arch" not in EngineLayout.parse("tp=2,gpu_arch=sm100").server_args()
    with pytest.raises(UnsupportedLayout, match="gpu_arch='sm120'"):
        EngineLayout.parse("tp=2,gpu_arch=sm120")
    with pytest.raises(UnsupportedLayout, match="draft role's Blackwell"):
        EngineLayout.parse("tp=2,gpu_arch=sm100,speculative_algorithm=EAGLE")
    assert fp8_engine.BLACKWELL_ARCHS == ("sm100",)


def test_the_answers_are_scoped_to_blackwell_models():
    import sys

    from sglang.srt.layers import deep_gemm_wrapper
    from sglang.srt.runtime_context import get_platform

    hopper = sglang_env.build_model(resolve_model(TINY), EngineLayout.parse("tp=1"), 0)
    with sglang_env.activate(hopper):
        assert not deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0 and "deep_gemm" not in sys.modules
    blackwell = sglang_env.build_model(resolve_model(TINY), EngineLayout.parse(SM100), 0)
    with sglang_env.activate(blackwell):
        assert deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0 and get_platform().is_sm100
    assert not deep_gemm_wrapper.DEEPGEMM_SCALE_UE8M0 and "deep_gemm" not in sys.modules


def test_connect_takes_an_fp8_blackwell_engine_of_128x128_blocks_and_refuses_ue8m0_checkpoints():
    info = {"version": replica_environment().sglang_version, "device": "cuda",
            "p2pw_device_archs": {"0": "sm100"}, "disable_shared_experts_fusion": False,
            "enforce_shared_experts_fusion": False, "moe_runner_backend": "deep_gemm", "moe_a2a_backend": "none",
            "fp8_gemm_runner_backend": "auto"}
    config = load_config(TINY)
    assert engine_identity("e0", info, config).layout_arch() == "sm100"  # connect builds a gpu_arch=sm100 layout
    ue8m0 = {**config, "quantization_config": {**config["quantization_config"], "scale_fmt": "ue8m0"}}
    with pytest.raises(EngineMismatch, match="UE8M0.*scale_fmt 'ue8m0'"):
        engine_identity("e0", info, ue8m0)
