"""vLLM's default Hopper kernels' post-processing, replayed on send, is byte-exact with vLLM's own.

Two transforms (replica/vllm_replay.py), each named by its test:
- ``deepgemm_e8m0``: FP8 128x128 block linears on DeepGEMM (``VLLM_USE_DEEP_GEMM=1``, vLLM's default):
  ``requant_weight_ue8m0_inplace``, then DeepGEMM's sm90 scale layout (the scales kept);
- ``flashinfer_cutlass_w31``: FP8 block experts on FlashInfer CUTLASS (vLLM's sm90 choice under EP):
  ``swap_w13_to_w31`` of w13 and its scales, block scales clamped.
The reference is vLLM's own ``load_weights`` + ``process_weights_after_loading`` of the rank under
the Hopper stand-in, with vLLM's oracles hearing the engine's DeepGEMM / FlashInfer answers
(replica/vllm_engine_kernels.py). What stays refused still refuses; the engine's finish does not
apply a replayed transform twice.
"""
from __future__ import annotations

import re

import pytest

try:
    import vllm  # noqa: F401
except ImportError as e:
    pytest.skip(f"vllm is not importable ({e}); install vllm 0.33.0 as docs/vllm.md says", allow_module_level=True)
torch = pytest.importorskip("torch")

from p2pweights.cli import main  # noqa: E402
from p2pweights.copyplans import NotACopy, record_group_plan  # noqa: E402
from p2pweights.errors import UnsupportedLayout  # noqa: E402
from p2pweights.models import load_config, resolve_model  # noqa: E402
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint  # noqa: E402
from p2pweights.models.quant import quant_scheme  # noqa: E402
from p2pweights.replica import vllm_env  # noqa: E402
from p2pweights.replica.vllm_check import check_byte_exact, reference_model  # noqa: E402
from p2pweights.replica.vllm_engine_kernels import _sm90_weight_scale_layout  # noqa: E402
from p2pweights.replica.vllm_layout import VllmLayout, refusal  # noqa: E402
from p2pweights.replica.vllm_replay import ModuleReplay, replayed_already, replayed_modules  # noqa: E402
from p2pweights.replica.vllm_replica import VllmReplicas  # noqa: E402
from p2pweights.vllm_backend.rank_memory import ServedModels  # noqa: E402

MODEL = "deepseek-v3-fp8-tiny"
DEEPGEMM = "tp=2"                      # DeepGEMM on (default), no EP: experts on Triton
FLASHINFER = "tp=2,ep=2,deep_gemm=0"   # EP, FlashInfer on (default): experts on FlashInfer CUTLASS
DEFAULTS = "tp=2,ep=2"                 # vLLM's defaults on Hopper: both


@pytest.fixture(scope="module")
def path():
    vllm_env.prepare()
    return str(resolve_model(MODEL))


@pytest.fixture(scope="module")
def replicas():
    return VllmReplicas()


def _slot_bytes(replica, tensors):
    """Every group of ``replica`` loaded (and replayed) into one slot: parameter name -> its bytes."""
    out = {}
    for group in replica.groups:
        slot = torch.full((group.nbytes,), 0xAB, dtype=torch.uint8)
        for region in replica.load_group(group, {n: tensors[n] for n in group.hf_names}, slot):
            spec = replica.param_specs[region.param_name]
            out[region.param_name] = slot[region.offset:region.offset + region.nbytes].view(
                getattr(torch, spec.dtype)).view(spec.shape).clone()
    return out


def _checkpoint(path, seed=0):
    cfg = load_config(path)
    return dict(random_checkpoint(checkpoint_tensors(cfg), seed, quant_scheme(cfg)))


def _mismatched_without_replay(path, spec, replicas, monkeypatch):
    """The parameters whose bytes differ from vLLM's when the sender writes the loaders' bytes."""
    monkeypatch.setattr(ModuleReplay, "apply", lambda self, *a, **k: [])
    result = check_byte_exact(path, VllmLayout.parse(spec), ranks=[0], replicas=VllmReplicas())
    return {re.search(r"(model\.[\w.]+): ", m).group(1) for m in result.mismatches}


def test_deepgemm_e8m0_fp8_linears_are_byte_exact_with_vllms_post_processing(path, replicas, monkeypatch):
    layout = VllmLayout.parse(DEEPGEMM)
    replayed = replicas.get(path, layout, 0).replayed
    assert set(replayed.values()) == {"deepgemm_e8m0"}
    assert "model.layers.0.self_attn.kv_b_proj" in replayed and "model.layers.1.mlp.shared_experts.gate_up_proj" in replayed
    result = check_byte_exact(path, layout, replicas=replicas)
    assert result.mismatches == [] and all(r.params_checked > 0 for r in result.ranks)
    # the transform is real: the loaders' bytes differ from the engine's in every replayed linear's weights
    differ = _mismatched_without_replay(path, DEEPGEMM, replicas, monkeypatch)
    assert differ and all(any(n.startswith(m + ".") for m in replayed) for n in differ)
    assert any(n.endswith(".weight_scale_inv") for n in differ) and any(n.endswith(".weight") for n in differ)


def test_flashinfer_cutlass_w31_experts_are_byte_exact_with_vllms_post_processing(path, replicas, monkeypatch):
    layout = VllmLayout.parse(FLASHINFER)
    for rank in range(layout.world_size):
        assert replicas.get(path, layout, rank).replayed == {"model.layers.1.mlp.experts.routed_experts":
                                                             "flashinfer_cutlass_w31"}
    result = check_byte_exact(path, layout, replicas=replicas)
    assert result.mismatches == []
    differ = _mismatched_without_replay(path, FLASHINFER, replicas, monkeypatch)
    assert differ == {"model.layers.1.mlp.experts.routed_experts.w13_weight",
                      "model.layers.1.mlp.experts.routed_experts.w13_weight_scale_inv"}


def test_each_transform_is_vllms_own_function_of_the_loaded_bytes(path, replicas, monkeypatch):
    """The replayed bytes equal vLLM's requant_weight_ue8m0_inplace / swap_w13_to_w31 applied to what
    the loaders wrote (so nothing but those functions changed the bytes)."""
    from vllm.model_executor.layers.quantization.utils.flashinfer_utils import swap_w13_to_w31
    from vllm.model_executor.layers.quantization.utils.fp8_utils import requant_weight_ue8m0_inplace

    tensors = _checkpoint(path)
    layout = VllmLayout.parse(DEFAULTS)
    replayed = _slot_bytes(replicas.get(path, layout, 1), tensors)
    with monkeypatch.context() as m:
        m.setattr(ModuleReplay, "apply", lambda self, *a, **k: [])
        loaded = _slot_bytes(VllmReplicas().get(path, layout, 1), tensors)
    w, s = (loaded[f"model.layers.0.self_attn.o_proj.{a}"].clone() for a in ("weight", "weight_scale_inv"))
    requant_weight_ue8m0_inplace(w, s, (128, 128))
    assert torch.equal(w.view(torch.uint8), replayed["model.layers.0.self_attn.o_proj.weight"].view(torch.uint8))
    assert torch.equal(s, replayed["model.layers.0.self_attn.o_proj.weight_scale_inv"])
    assert torch.equal(torch.log2(s), torch.log2(s).round())  # UE8M0: powers of two
    experts = "model.layers.1.mlp.experts.routed_experts."
    for attr in ("w13_weight", "w13_weight_scale_inv"):
        assert torch.equal(swap_w13_to_w31(loaded[experts + attr]).view(torch.uint8),
                           replayed[experts + attr].view(torch.uint8))
    assert torch.equal(loaded[experts + "w2_weight"].view(torch.uint8), replayed[experts + "w2_weight"].view(torch.uint8))


@pytest.mark.parametrize("spec", [DEFAULTS, DEFAULTS + ",spec=mtp"], ids=["target", "with-mtp-draft"])
def test_check_layout_accepts_vllms_default_hopper_configuration(path, capsys, spec):
    assert main(["check-layout", "--engine-kind", "vllm", "--model", path, "--engine", spec]) == 0
    assert "OK, byte-exact over 2 rank(s)" in capsys.readouterr().out


@pytest.mark.parametrize("spec,names", [
    ("tp=2,ep=2,flashinfer=0", "DeepGEMM's MoE"),
    ("tp=2,ep=2,moe_backend=deep_gemm", "--moe-backend triton"),
    ("tp=2,ep=2,moe_backend=flashinfer_cutlass,flashinfer=0", "flashinfer=0"),
], ids=["deepgemm-experts-without-flashinfer", "deepgemm-experts-asked", "flashinfer-cutlass-without-flashinfer"])
def test_the_rewrites_not_replayed_are_still_refused_saying_why(path, capsys, spec, names):
    layout = VllmLayout.parse(spec)
    assert names in refusal(load_config(path), layout)
    with pytest.raises(UnsupportedLayout, match=re.escape(names)):
        vllm_env.build_model(path, layout, 0)
    assert main(["check-layout", "--engine-kind", "vllm", "--model", path, "--engine", spec]) == 2
    assert names in capsys.readouterr().err


def test_deepgemm_scale_layouts_other_than_sm90_fp32_blocks_are_refused():
    """DeepGEMM's scale layout is a CUDA kernel: only its sm90 branch for FP32 128x128 weight scales
    (the scales as they are) is taken; the per-token (1 x 128) and integer (Blackwell) branches refuse."""
    sf = torch.ones(1, 4, 2)
    assert _sm90_weight_scale_layout(sf, 512, 256, (1, 128, 128), 1, False) is sf
    with pytest.raises(UnsupportedLayout, match="CUDA kernel"):
        _sm90_weight_scale_layout(sf, 512, 256, (1, 128, 128), 1, True)  # an activation's 1 x 128 scales
    with pytest.raises(UnsupportedLayout, match="CUDA kernel"):
        _sm90_weight_scale_layout(sf.int(), 512, 256, (1, 128, 128), 1, False)
    with pytest.raises(UnsupportedLayout, match="SFB check"):
        _sm90_weight_scale_layout(torch.ones(1, 3, 2), 512, 256, (1, 128, 128), 1, False)


def test_groups_whose_bytes_are_replayed_never_become_copy_plans(path, replicas):
    replica = replicas.get(path, VllmLayout.parse(DEFAULTS), 0)
    tensors = _checkpoint(path)
    replayed = [g for g in replica.groups if replica.not_a_copy(g)]
    assert replayed and len(replayed) < len(replica.groups)
    group = replayed[0]
    with pytest.raises(NotACopy, match="replayed"):
        record_group_plan(replica, group, {n: tensors[n] for n in group.hf_names})


def test_the_engines_finish_does_not_apply_a_replayed_transform_twice(path):
    """After the writes the engine's parameters hold post-processed bytes; its finish
    (ServedModels.post_process) leaves them as they are. Without the hook the w13 halves swap back."""
    layout = VllmLayout.parse(DEFAULTS)
    model = reference_model(path, layout, 0)  # what the sender's writes leave in the engine
    before = {n: p.detach().contiguous().clone() for n, p in model.named_parameters()}
    served = ServedModels(model, model._p2pw_vllm_config.model_config)
    with vllm_env.activate(model):
        served.post_process(torch.device("cpu"))
    changed = [n for n, p in model.named_parameters() if n in before and not torch.equal(
        p.detach().contiguous().view(torch.uint8), before[n].view(torch.uint8))]
    assert changed == []
    with replayed_already([model]) as names:
        assert set(names) == set(replayed_modules(model))
    with vllm_env.activate(model):  # vLLM's post-processing alone: the transform applied a second time
        vllm_env.post_process(model)
    w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    assert not torch.equal(dict(model.named_parameters())[w13].view(torch.uint8), before[w13].view(torch.uint8))


def test_a_one_percent_change_moves_only_post_processed_bytes(path, replicas):
    """The delta compare runs on the slot's bytes, now post-processed: changing 1% of one expert's up
    rows changes bytes in the FIRST half of w13 (FlashInfer's w31 order), and both slots equal
    vLLM's post-processed loads."""
    layout = VllmLayout.parse(DEFAULTS)
    replica = replicas.get(path, layout, 0)
    base = _checkpoint(path)
    up = "model.layers.1.mlp.experts.0.up_proj.weight"
    changed = dict(base)
    changed[up] = base[up].clone()
    rows = max(1, base[up].shape[0] // 100)
    changed[up][:rows] = (-changed[up][:rows].float()).to(changed[up].dtype)  # FP8 values negated: exact
    a, b = _slot_bytes(replica, base), _slot_bytes(replica, changed)
    w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
    diff = (a[w13].view(torch.uint8) != b[w13].view(torch.uint8)).nonzero()
    assert diff.numel() and set(diff[:, 0].tolist()) == {0}  # expert 0; its up half first (w31): rows 0..
    assert set(diff[:, 1].tolist()) <= set(range(rows))
    assert [n for n in a if not torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8))] == [w13]
