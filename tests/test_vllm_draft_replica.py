"""The vLLM replica's draft role: a DeepSeek-V3 engine started with an MTP draft
(``--speculative-config '{"method": "mtp"}'``) holds vLLM's ``DeepSeekMTP`` on every rank, and the
replica writes exactly the bytes it holds after loading and post-processing, except its embedding
and LM heads, which vLLM's proposer replaces by the target's (not the draft's to write).

Each case checks every rank and role against vLLM's own ``load_weights`` +
``process_weights_after_loading`` on a materialized CPU model of the same rank (the draft then
given the target's embedding and head, as the proposer does). Shapes are tiny.
"""
from __future__ import annotations

import json
import os

import pytest

try:
    import vllm  # noqa: F401  (the platform is not resolved by this import)
except ImportError as e:  # the only reason to skip: docs/vllm.md says how to install it
    pytest.skip(f"vllm is not importable ({e}); install vllm 0.33.0 as docs/vllm.md says",
                allow_module_level=True)
torch = pytest.importorskip("torch")

from p2pweights.cli import main  # noqa: E402
from p2pweights.errors import LayoutSpecError, UnknownParameter, UnsupportedLayout  # noqa: E402
from p2pweights.models import load_config  # noqa: E402
from p2pweights.models.checkpoint import RandomCheckpoint, checkpoint_tensors  # noqa: E402
from p2pweights.models.quant import quant_scheme  # noqa: E402
from p2pweights.replica import vllm_env  # noqa: E402
from p2pweights.replica.roles import RankRoles  # noqa: E402
from p2pweights.replica.vllm_check import check_rank, check_rank_roles, reference_model  # noqa: E402
from p2pweights.replica.vllm_layout import VllmLayout, refusal  # noqa: E402
from p2pweights.replica.vllm_replica import VllmModelReplica, VllmReplicas, vllm_rank_replica  # noqa: E402
from replica_configs import write_config  # noqa: E402

# the built-in deepseek-v3-fp8-tiny (one MTP layer: model.layers.2), with and without its FP8 blocks
_DSV3_FP8 = load_config("deepseek-v3-fp8-tiny")
_DSV3_BF16 = {k: v for k, v in _DSV3_FP8.items() if k != "quantization_config"}
_CONFIGS = {"dsv3_fp8": _DSV3_FP8, "dsv3_bf16": _DSV3_BF16}
_MTP = _DSV3_FP8["num_hidden_layers"]  # the MTP layer's index in the checkpoint
# draft parameters that are the target's after vLLM's proposer shares them
_SHARED = ("model.embed_tokens.weight", f"model.layers.{_MTP}.shared_head.head.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    vllm_env.prepare()
    root = str(tmp_path_factory.mktemp("vllm_draft_configs"))

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


CASES = [
    ("dsv3_bf16", "tp=1,spec=mtp"),
    ("dsv3_bf16", "tp=2,ep=2,spec=mtp"),
    ("dsv3_fp8", "tp=1,deep_gemm=0,spec=mtp"),
    ("dsv3_fp8", "tp=2,ep=2,deep_gemm=0,moe_backend=triton,spec=mtp"),
]


@pytest.mark.parametrize("model,spec", CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_every_role_of_every_rank_matches_vllms_load_and_post_processing(configs, replicas, model, spec):
    path, layout = configs(model), VllmLayout.parse(spec)
    for rank in range(layout.world_size):
        per_role = check_rank_roles(path, layout, rank, replicas=replicas)
        assert list(per_role) == ["target", "draft"]
        for role, result in per_role.items():
            assert result.mismatches == [], (rank, role)
            replica = replicas.get(path, layout, rank, role=role)
            # every parameter the role holds was written by a group and compared
            assert result.params_checked == len(replica.param_specs) - len(replica.mapping.derived) > 0
            assert any(n.endswith(".W_UV") for n in result.post_processed)  # MLA's, recomputed, never written
            if model == "dsv3_fp8":  # FP8 weights and their float32 block scales were compared
                assert result.dtypes.get("float8_e4m3fn", 0) > 0 and result.dtypes.get("float32", 0) > 0
        draft = replicas.get(path, layout, rank, role="draft")
        assert all(n.startswith(f"model.layers.{_MTP}.") for n in draft.param_specs)
        assert not set(_SHARED) & set(draft.param_specs)


def test_the_joined_rank_publishes_draft_names_without_the_shared_ones(configs, replicas):
    path, layout = configs("dsv3_fp8"), VllmLayout.parse("tp=2,ep=2,deep_gemm=0,moe_backend=triton,spec=mtp")
    joined = vllm_rank_replica(replicas, path, layout, 1)
    assert isinstance(joined, RankRoles) and set(joined.roles) == {"target", "draft"}
    names = set(joined.param_specs)
    assert {f"draft.model.layers.{_MTP}.enorm.weight",
            f"draft.model.layers.{_MTP}.mtp_block.self_attn.kv_b_proj.weight",
            f"draft.model.layers.{_MTP}.mtp_block.mlp.experts.routed_experts.w13_weight"} <= names
    assert not {f"draft.{n}" for n in _SHARED} & names
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= names  # the target's, published once
    # the draft's meta model holds exactly what it publishes: the shared ones are the target's objects
    draft = joined.roles["draft"]
    assert [n for n, _ in draft.model.named_parameters()] == list(draft.param_specs)
    # HF tensors read only into the shared modules reach nothing of the engine: ignored, not unknown
    for hf in (f"model.layers.{_MTP}.embed_tokens.weight", f"model.layers.{_MTP}.shared_head.head.weight"):
        assert joined.group_of(hf) is None
    assert joined.group_of("model.embed_tokens.weight").params == ("model.embed_tokens.weight",)
    assert joined.group_of(f"model.layers.{_MTP}.enorm.weight").params == (f"draft.model.layers.{_MTP}.enorm.weight",)
    with pytest.raises(UnknownParameter):
        joined.group_of(f"model.layers.{_MTP + 1}.enorm.weight")
    assert vllm_rank_replica(replicas, path, layout, 1) is joined  # one joined object per rank's roles


def test_the_joined_rank_writes_each_roles_bytes_under_its_name(configs, replicas):
    path, layout = configs("dsv3_bf16"), VllmLayout.parse("tp=2,ep=2,spec=mtp")
    joined = vllm_rank_replica(replicas, path, layout, 0)
    source = RandomCheckpoint(checkpoint_tensors(path), 5, quant_scheme(load_config(path)))
    slot = torch.full((joined.largest_group_nbytes,), 0xAB, dtype=torch.uint8)
    written = {}
    for group in joined.groups:
        for region in joined.load_group(group, {n: source.tensor(n) for n in group.hf_names}, slot):
            written[region.param_name] = slot[region.offset:region.offset + region.nbytes].clone()
    assert set(written) == set(joined.param_specs)
    for role in ("target", "draft"):
        reference = dict(reference_model(path, layout, 0, seed=5, role=role).named_parameters())
        prefix = "draft." if role == "draft" else ""
        for name in joined.roles[role].param_specs:
            want = reference[name].detach().contiguous().view(-1).view(torch.uint8)
            assert torch.equal(written[prefix + name], want), prefix + name


def test_post_processing_that_rewrites_the_drafts_bytes_is_caught(configs, replicas, monkeypatch):
    """The draft is compared with the post-processed draft: a kernel rewriting its eh_proj after
    loading must show up as a mismatch of the draft role naming it, the target unaffected."""
    original = vllm_env.post_process

    def rewriting(model, device="cpu", role="target"):
        original(model, device, role)
        if role == "draft":
            for name, p in model.named_parameters():
                if name.endswith("eh_proj.weight"):
                    p.data.mul_(2)
    monkeypatch.setattr(vllm_env, "post_process", rewriting)
    path, layout = configs("dsv3_bf16"), VllmLayout.parse("tp=1,spec=mtp")
    assert check_rank(path, layout, 0, replicas=replicas).mismatches == []
    mismatches = check_rank(path, layout, 0, replicas=replicas, role="draft").mismatches
    assert mismatches and all("eh_proj.weight" in m for m in mismatches)


def test_an_engine_without_a_weighted_draft_keeps_its_target_only_replica(configs, replicas):
    path = configs("dsv3_bf16")
    for spec in ("tp=1", "tp=1,spec=ngram"):
        layout = VllmLayout.parse(spec)
        assert layout.spec == "" and layout.roles == ("target",)
        assert isinstance(vllm_rank_replica(replicas, path, layout, 0), VllmModelReplica)
        with pytest.raises(UnsupportedLayout, match="no 'draft' model"):
            replicas.get(path, layout, 0, role="draft")


def test_the_spec_setting_parses_describes_and_reaches_vllms_engine_args():
    layout = VllmLayout.parse("tp=2,ep=2,moe_backend=triton,deep_gemm=0,spec=mtp")
    assert layout.spec == "mtp" and layout.roles == ("target", "draft")
    assert layout.describe() == "vllm:tp=2,ep=2,moe_backend=triton,deep_gemm=0,spec=mtp"
    assert layout.engine_args()["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 1}
    assert "speculative_config" not in VllmLayout.parse("tp=2").engine_args()
    assert VllmLayout.parse("tp=1,speculative=MTP") == VllmLayout.parse("tp=1,speculative_method=mtp") \
        == VllmLayout(spec="mtp")
    assert VllmLayout.parse("tp=1,spec=mtp").key != VllmLayout.parse("tp=1").key  # a replica cache key
    assert VllmLayout.parse("tp=1,spec=deepseek_mtp").spec == "mtp"  # vLLM's deprecated name of mtp
    assert [VllmLayout.parse(f"tp=1,spec={m}").spec for m in ("ngram", "ngram_gpu", "suffix")] == ["", "", ""]


@pytest.mark.parametrize("method", ["eagle", "eagle3", "draft_model"])
def test_a_separate_draft_checkpoint_is_refused_naming_the_setting(method):
    with pytest.raises(LayoutSpecError, match=f"spec={method}.*separate draft checkpoint.*mtp"):
        VllmLayout.parse(f"tp=1,spec={method}")


def test_an_mtp_draft_the_replica_cannot_build_is_refused_naming_the_fix(configs, capsys):
    qwen = configs("qwen3_moe")
    layout = VllmLayout.parse("tp=2,spec=mtp")
    assert "Qwen3MoeForCausalLM" in refusal(load_config(qwen), layout)
    with pytest.raises(UnsupportedLayout, match="spec=mtp.*--speculative-config"):
        vllm_env.build_model(qwen, layout, 0)
    assert main(["check-layout", "--engine-kind", "vllm", "--model", qwen, "--engine", "tp=2,spec=mtp"]) == 2
    assert "spec=mtp" in capsys.readouterr().err
    no_mtp = configs("dsv3_bf16", num_nextn_predict_layers=0)
    assert "no MTP layer" in refusal(load_config(no_mtp), VllmLayout.parse("tp=1,spec=mtp"))
    assert refusal(load_config(no_mtp), VllmLayout.parse("tp=1")) is None


def test_check_layout_cli_reports_every_role_as_json(configs, capsys):
    path = configs("dsv3_fp8")
    spec = "tp=2,ep=2,deep_gemm=0,moe_backend=triton,spec=mtp"
    assert main(["check-layout", "--engine-kind", "vllm", "--model", path, "--engine", spec, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["equal"] and out["engine_kind"] == "vllm" and [r["rank"] for r in out["ranks"]] == [0, 1]
    assert set(out["roles"]) == {"target", "draft"}
    for role in ("target", "draft"):
        entry = out["roles"][role]
        assert entry["equal"] and [r["rank"] for r in entry["ranks"]] == [0, 1] and entry["params_checked"] > 0
    assert out["params_checked"] == out["roles"]["target"]["params_checked"] + out["roles"]["draft"]["params_checked"]
