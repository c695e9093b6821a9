"""The replica path writes exactly the bytes sglang's own loader would, for every rank and layout.

Each byte-exactness case builds tiny random configs of the supported architectures, pushes
random HF tensors through the replica (probe, parameter groups, one slot) and through sglang's
``load_weights`` into a fully materialized model of the same rank, and compares every
parameter. sglang is imported once per session (≈10 s); each case then takes well under 1 s.
"""
from __future__ import annotations

import json

import pytest

from conftest import require_sglang

require_sglang()
torch = pytest.importorskip("torch")

from p2pweights.cli import main  # noqa: E402
from p2pweights.errors import LayoutMismatch, MissingTensors, UnknownParameter, UnsupportedLayout  # noqa: E402
from p2pweights.models.checkpoint import checkpoint_tensors, random_tensor  # noqa: E402
from p2pweights.replica import (  # noqa: E402
    SLOT_ALIGNMENT,
    EngineLayout,
    ModelReplica,
    ModelReplicas,
    parse_engine_spec,
    sglang_env,
)
from p2pweights.replica.check import check_byte_exact, compare_with_reference  # noqa: E402
from p2pweights.replica.reference import reference_model  # noqa: E402
from replica_configs import write_config  # noqa: E402


@pytest.fixture(scope="session")
def configs(tmp_path_factory):
    sglang_env.prepare()
    root = tmp_path_factory.mktemp("configs")
    return lambda name: write_config(name, str(root))


# (config, engine spec): TP 1/2/4, EP 2/4, DP attention, DP lm-head, fused shared experts,
# vocab 250 (not divisible by TP 4), tied and untied embeddings, MLA (cat into fused_qkv_a).
BYTE_EXACT_CASES = [
    ("qwen2", "tp=1"),
    ("qwen2", "tp=4"),
    ("qwen2_tied", "tp=2"),
    ("qwen3", "tp=2"),
    ("qwen3", "tp=4"),
    ("qwen3", "tp=4,dp_attention=2"),
    ("qwen3", "tp=4,dp_attention=4,enable_dp_lm_head=true"),
    ("qwen3_moe", "tp=2"),
    ("qwen3_moe", "tp=2,ep=2"),
    ("qwen3_moe", "tp=4,ep=2"),
    ("qwen3_moe", "tp=4,ep=4"),
    ("qwen3_moe", "tp=4,ep=4,dp_attention=2"),
    ("qwen3_moe", "tp=4,ep=2,dp_attention=4,enable_dp_lm_head=true"),
    ("deepseek_v3", "tp=2"),
    ("deepseek_v3", "tp=4,ep=4"),
    ("deepseek_v3", "tp=4,ep=4,dp_attention=4"),
    ("deepseek_v3", "tp=2,enforce_shared_experts_fusion=true"),
    ("deepseek_v3", "tp=4,ep=2,dp_attention=2,enforce_shared_experts_fusion=true"),
    ("glm4_moe", "tp=2,ep=2"),
    ("glm4_moe", "tp=4,enforce_shared_experts_fusion=true"),
    ("glm4_moe_lite", "tp=2,ep=2"),
    ("glm4_moe_lite", "tp=4,ep=4,dp_attention=2"),
]


@pytest.mark.parametrize("model,spec", BYTE_EXACT_CASES, ids=[f"{m}-{s}" for m, s in BYTE_EXACT_CASES])
def test_every_parameter_of_every_rank_matches_sglangs_loader(configs, model, spec):
    engine = EngineLayout.parse(spec)
    result = check_byte_exact(configs(model), engine)
    assert result.mismatches == []
    assert result.equal
    assert [r.rank for r in result.ranks] == list(range(engine.world_size))
    for r in result.ranks:  # every parameter of the rank was written by some group and checked
        replica = ModelReplicas(cache_dir="").get(configs(model), engine, r.rank)
        assert r.params_checked == len(replica.param_specs) > 0


def test_the_comparison_fails_for_another_ranks_bytes(configs):
    engine = EngineLayout.parse("tp=2,ep=2")
    replica = ModelReplicas(cache_dir="").get(configs("qwen3_moe"), engine, 0)
    wrong = reference_model(configs("qwen3_moe"), engine, 1)
    result = compare_with_reference(replica, wrong)
    assert not result.equal
    assert any("qkv_proj" in m for m in result.mismatches)
    assert any("w13_weight" in m for m in result.mismatches)


def test_the_comparison_fails_for_another_seed(configs):
    engine = EngineLayout.parse("tp=2")
    replica = ModelReplicas(cache_dir="").get(configs("qwen3"), engine, 1)
    result = compare_with_reference(replica, reference_model(configs("qwen3"), engine, 1, seed=1), seed=0)
    assert len(result.mismatches) == len(replica.param_specs)


def test_dp_attention_shards_attention_over_the_attention_tp_group_only(configs):
    plain = ModelReplicas(cache_dir="").get(configs("qwen3"), EngineLayout.parse("tp=4"), 3)
    dp = ModelReplicas(cache_dir="").get(configs("qwen3"), EngineLayout.parse("tp=4,dp_attention=2"), 3)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    # 4 q heads, 2 kv heads of 16: attention TP 4 holds 1 q + 1 (replicated) k + 1 v head;
    # attention TP 2 (DP attention 2 over TP 4) holds 2 q + 1 k + 1 v. The MLP stays TP 4.
    assert plain.param_specs[qkv].shape == (48, 64)
    assert dp.param_specs[qkv].shape == (64, 64)
    mlp = "model.layers.0.mlp.gate_up_proj.weight"
    assert dp.param_specs[mlp] == plain.param_specs[mlp]


def test_probe_follows_data_through_cat_into_fused_qkv_a_proj(configs):
    replica = ModelReplicas(cache_dir="").get(configs("deepseek_v3"), EngineLayout.parse("tp=2"), 0)
    sources = replica.mapping.sources["model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"]
    assert sources == ["model.layers.0.self_attn.q_a_proj.weight", "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]


def test_fused_shared_expert_joins_the_routed_experts_group(configs):
    replica = ModelReplicas(cache_dir="").get(
        configs("deepseek_v3"), EngineLayout.parse("tp=2,enforce_shared_experts_fusion=true"), 0)
    w13 = replica.mapping.sources["model.layers.1.mlp.experts.w13_weight"]
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in w13
    assert replica.param_specs["model.layers.1.mlp.experts.w13_weight"].shape[0] == 8 + 1
    assert not any("shared_experts" in p for p in replica.param_specs)


def test_qkv_and_gate_up_are_one_group_each(configs):
    replica = ModelReplicas(cache_dir="").get(configs("qwen3"), EngineLayout.parse("tp=2"), 0)
    group = replica.group_of("model.layers.0.self_attn.k_proj.weight")
    assert group.params == ("model.layers.0.self_attn.qkv_proj.weight",)
    assert set(group.hf_names) == {f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"}
    assert replica.group_of("model.layers.0.mlp.up_proj.weight") is replica.group_of("model.layers.0.mlp.gate_proj.weight")
    # groups partition the parameters
    params = [p for g in replica.groups for p in g.params]
    assert sorted(params) == sorted(replica.param_specs)


def test_expert_parallel_rank_drops_other_ranks_experts_and_rejects_unknown_names(configs):
    replica = ModelReplicas(cache_dir="").get(configs("qwen3_moe"), EngineLayout.parse("tp=2,ep=2"), 1)
    assert replica.group_of("model.layers.0.mlp.experts.0.gate_proj.weight") is None  # rank 0's expert
    assert replica.group_of("model.layers.0.mlp.experts.7.gate_proj.weight") is not None
    with pytest.raises(UnknownParameter, match=r"model\.layers\.0\.mlp\.experts\.99\.gate_proj\.weight"):
        replica.group_of("model.layers.0.mlp.experts.99.gate_proj.weight")
    with pytest.raises(UnknownParameter, match="lm_head.bias"):
        replica.group_of("lm_head.bias")


def test_mtp_layers_of_the_checkpoint_are_dropped_by_the_target_model(configs):
    replica = ModelReplicas(cache_dir="").get(configs("deepseek_v3"), EngineLayout.parse("tp=2"), 0)
    assert "model.layers.2.eh_proj.weight" in replica.hf_specs  # num_nextn_predict_layers = 1
    assert replica.group_of("model.layers.2.eh_proj.weight") is None


def test_slot_regions_are_aligned_disjoint_and_sized_by_the_engine(configs):
    replica = ModelReplicas(cache_dir="").get(configs("qwen3_moe"), EngineLayout.parse("tp=2,ep=2"), 0)
    for group in replica.groups:
        end = 0
        for region in group.regions:
            assert region.offset % SLOT_ALIGNMENT == 0 and region.offset >= end
            assert region.nbytes == replica.param_nbytes(region.param_name)
            end = region.offset + region.nbytes
        assert group.nbytes == end <= replica.largest_group_nbytes
    w13 = replica.param_specs["model.layers.0.mlp.experts.w13_weight"]
    assert replica.param_nbytes("model.layers.0.mlp.experts.w13_weight") == 4 * 64 * 64 * 2 == w13.nbytes


def test_two_groups_share_a_slot_at_their_offsets(configs):
    engine = EngineLayout.parse("tp=2")
    replica = ModelReplicas(cache_dir="").get(configs("qwen3"), engine, 0)
    reference = dict(reference_model(configs("qwen3"), engine, 0).named_parameters())
    a, b = replica.groups[1], replica.groups[2]
    slot = torch.full((a.nbytes + b.nbytes + 2 * SLOT_ALIGNMENT,), 0xAB, dtype=torch.uint8)
    second = -(-a.nbytes // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
    regions = []
    for group, offset in ((a, 0), (b, second)):
        inputs = {n: random_tensor(n, replica.hf_specs[n]) for n in group.hf_names}
        regions += replica.load_group(group, inputs, slot, offset)
    for r in regions:
        want = reference[r.param_name].detach().reshape(-1).view(torch.uint8)
        assert torch.equal(slot[r.offset:r.offset + r.nbytes], want), r.param_name
    with pytest.raises(LayoutMismatch, match="multiple of 256"):
        replica.load_group(a, {n: random_tensor(n, replica.hf_specs[n]) for n in a.hf_names}, slot, 8)


def test_stale_slot_bytes_never_leak_and_bytes_between_groups_stay_untouched(configs):
    # vocab 250 at TP 4: the last rank's embedding has padding rows the loader never writes
    engine = EngineLayout.parse("tp=4")
    replica = ModelReplicas(cache_dir="").get(configs("qwen2"), engine, 3)
    reference = dict(reference_model(configs("qwen2"), engine, 3).named_parameters())
    gap = 4 * SLOT_ALIGNMENT  # another engine rank's bytes would sit here
    placed, off = [], 0
    for i, g in enumerate(replica.groups):
        placed.append((g, off))
        off = -(-(off + g.nbytes) // SLOT_ALIGNMENT) * SLOT_ALIGNMENT + (gap if i == 1 else 0)
    slot = torch.full((off + gap,), 0xAB, dtype=torch.uint8)
    inputs = {n: random_tensor(n, replica.hf_specs[n]) for g, _ in placed for n in g.hf_names}
    regions = replica.load_groups(placed, inputs, slot)
    for r in regions:
        want = reference[r.param_name].detach().reshape(-1).view(torch.uint8)
        assert torch.equal(slot[r.offset:r.offset + r.nbytes], want), r.param_name
    g1, o1 = placed[1]
    after_g1 = -(-(o1 + g1.nbytes) // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
    assert bool((slot[after_g1:after_g1 + gap] == 0xAB).all())
    assert bool((slot[off:] == 0xAB).all())


def test_the_probe_records_which_bytes_of_a_parameter_the_loaders_overwrite():
    from p2pweights.replica.probe import _covers, _DataFlow

    flow = _DataFlow()
    full, rows, cols, rmw = (torch.empty(8, 4, dtype=torch.bfloat16, device="meta") for _ in range(4))
    src = torch.empty(8, 4, dtype=torch.bfloat16, device="meta")
    for p in (full, rows, cols, rmw):
        flow.watch(p)
    with flow:
        full.narrow(0, 0, 5).copy_(src[:5])
        full[5:].fill_(0)  # padding rows written by the loader itself
        rows.narrow(0, 0, 6).copy_(src[:6])  # rows 6, 7 never written
        cols[:, :2].copy_(src[:, :2])  # a strided view: every row, half the columns
        rmw.add_(1)  # reads old bytes: does not count as written
    nbytes = 8 * 4 * 2
    assert _covers(flow.written_bytes(full), nbytes)
    assert flow.written_bytes(rows) == [(0, 48)] and not _covers(flow.written_bytes(rows), nbytes)
    assert flow.written_bytes(cols) == [(i * 8, i * 8 + 4) for i in range(8)]
    assert not _covers(flow.written_bytes(cols), nbytes)
    assert not _covers(flow.written_bytes(rmw), nbytes)


def test_a_partly_written_parameter_is_zeroed_before_each_load(configs):
    engine = EngineLayout.parse("tp=2")
    fresh = ModelReplicas(cache_dir="").get(configs("qwen3"), engine, 0)
    assert fresh.mapping.partial == []  # sglang's loaders write every byte here, padding included
    # pretend the embedding's loader left rows unwritten: it must be zeroed in the slot first
    mapping = fresh.mapping
    mapping = type(mapping)(mapping.sources, mapping.param_specs, mapping.hf_specs, mapping.ignored,
                            partial=["model.embed_tokens.weight"])
    replica = ModelReplica(configs("qwen3"), engine, 0, mapping)
    group = replica.group_of("model.embed_tokens.weight")
    slot = torch.full((group.nbytes,), 0xAB, dtype=torch.uint8)
    empty = {n: torch.zeros(replica.hf_specs[n].shape, dtype=torch.bfloat16)[:0] for n in group.hf_names}
    with pytest.raises((RuntimeError, AssertionError, ValueError)):
        replica.load_group(group, empty, slot)  # wrong shapes fail in the loader...
    assert bool((slot[:group.regions[0].nbytes] == 0).all())  # ...after the parameter was zeroed


def test_parameters_keep_class_and_loader_and_go_back_to_meta(configs):
    replica = ModelReplicas(cache_dir="").get(configs("deepseek_v3"), EngineLayout.parse("tp=2"), 0)
    model = replica.model
    before = {n: (type(p), p.__dict__.get("weight_loader")) for n, p in model.named_parameters()}
    attn = model.model.layers[1].self_attn
    derived_before = {k: v for k, v in vars(attn).items() if isinstance(v, torch.Tensor)}
    slot = torch.empty(replica.largest_group_nbytes, dtype=torch.uint8)
    for _ in range(2):  # the first load learns which modules get derived tensors, the second uses that
        for group in replica.groups:
            replica.load_group(group, {n: random_tensor(n, replica.hf_specs[n]) for n in group.hf_names}, slot)
    after = dict(model.named_parameters())
    assert all(p.device.type == "meta" for p in after.values())
    assert {n: (type(p), p.__dict__.get("weight_loader")) for n, p in after.items()} == before
    # w_kc / w_vc computed from kv_b_proj must not keep pointing into the slot
    for k, v in vars(attn).items():
        if isinstance(v, torch.Tensor):
            assert v is derived_before.get(k), k


def test_derived_tensors_a_loader_hangs_on_modules_never_outlive_the_load(configs):
    # a loader that re-derives w_kc from kv_b_proj during load_weights (pointing into the slot)
    replica = ModelReplicas(cache_dir="").get(configs("deepseek_v3"), EngineLayout.parse("tp=2"), 0)
    model = replica.model
    attn = model.model.layers[1].self_attn
    original = model.load_weights

    def load_weights(weights):
        original(weights)
        w = attn.kv_b_proj.weight
        if w.device.type != "meta":
            attn.w_kc = w.data[:4]

    model.load_weights = load_weights
    try:
        group = replica.group_of("model.layers.1.self_attn.kv_b_proj.weight")
        slot = torch.empty(replica.largest_group_nbytes, dtype=torch.uint8)
        before = vars(attn).get("w_kc")
        for _ in range(2):  # the first load learns that self_attn gets derived tensors, the second uses it
            replica.load_group(group, {n: random_tensor(n, replica.hf_specs[n]) for n in group.hf_names}, slot)
            assert vars(attn).get("w_kc") is before
        assert attn in replica._derived_modules[group.index]
        other = replica.group_of("model.layers.1.self_attn.o_proj.weight")
        replica.load_group(other, {n: random_tensor(n, replica.hf_specs[n]) for n in other.hf_names}, slot)
        assert replica._derived_modules[other.index] == []  # o_proj's loads hang nothing on self_attn
    finally:
        del model.load_weights


@pytest.mark.parametrize("model", ["qwen2_tied", "deepseek_v3", "qwen3_moe"])
def test_loaders_see_the_same_named_parameters_as_torchs_walk(configs, model):
    from p2pweights.replica.model_replica import _first_sites, _named_parameters_from_sites

    replica = ModelReplicas(cache_dir="").get(configs(model), EngineLayout.parse("tp=2"), 1)
    m = replica.model
    walk = list(m.named_parameters())
    with _named_parameters_from_sites(m, _first_sites(sglang_env.parameter_sites(m))):
        fast = list(m.named_parameters())
        assert list(m.named_parameters(remove_duplicate=False)) == list(type(m).named_parameters(m, remove_duplicate=False))
    assert [n for n, _ in fast] == [n for n, _ in walk]
    assert all(a is b for (_, a), (_, b) in zip(fast, walk))
    assert "named_parameters" not in vars(m)


def test_materialize_keeps_loaders_and_ties(configs):
    model = sglang_env.build_model(configs("qwen2_tied"), EngineLayout.parse("tp=2"), 0)
    loader = model.model.embed_tokens.weight.weight_loader
    sglang_env.materialize(model)
    assert model.model.embed_tokens.weight.device.type == "cpu"
    assert model.model.embed_tokens.weight.weight_loader == loader
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_incomplete_or_foreign_group_inputs_are_refused(configs):
    replica = ModelReplicas(cache_dir="").get(configs("qwen3"), EngineLayout.parse("tp=2"), 0)
    group = replica.group_of("model.layers.0.self_attn.q_proj.weight")
    slot = torch.empty(replica.largest_group_nbytes, dtype=torch.uint8)
    some = {n: random_tensor(n, replica.hf_specs[n]) for n in group.hf_names[:2]}
    with pytest.raises(MissingTensors, match="v_proj"):
        replica.load_group(group, some, slot)
    full = {n: random_tensor(n, replica.hf_specs[n]) for n in group.hf_names}
    full["model.norm.weight"] = random_tensor("model.norm.weight", replica.hf_specs["model.norm.weight"])
    with pytest.raises(UnknownParameter, match="model.norm.weight"):
        replica.load_group(group, full, slot)


# -- rejections ---------------------------------------------------------------------------------
@pytest.mark.parametrize("flag,value", [
    ("ep_num_redundant_experts", 8),
    ("init_expert_location", "/tmp/expert_location.json"),
    ("enable_eplb", True),
    ("elastic_ep_backend", "mooncake"),
    ("dwdp_size", 2),
    ("kt_weight_path", "/models/kt"),
    ("quantization", "awq"),  # fp8 is accepted over an FP8 checkpoint (tests/test_fp8_replica.py)
])
def test_layouts_a_replica_cannot_reproduce_are_rejected_naming_the_flag(flag, value):
    info = {"tp_size": 2, "ep_size": 2, "port": 30000, flag: value}
    with pytest.raises(UnsupportedLayout, match=flag):
        EngineLayout.from_server_info(info)
    with pytest.raises(UnsupportedLayout, match=flag):
        EngineLayout.parse(f"tp=2,ep=2,{flag}={json.dumps(value) if not isinstance(value, str) else value}")


def test_a_parameter_no_hf_name_reaches_is_rejected_naming_it(configs):
    specs = checkpoint_tensors(configs("qwen3"))
    del specs["model.norm.weight"]
    with pytest.raises(UnsupportedLayout, match=r"model\.norm\.weight"):
        ModelReplicas(cache_dir="").get(configs("qwen3"), EngineLayout.parse("tp=2"), 0, hf_specs=specs)


def test_an_architecture_without_a_checkpoint_schema_is_rejected_naming_it(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MysteryForCausalLM"]}))
    with pytest.raises(UnsupportedLayout, match="MysteryForCausalLM"):
        checkpoint_tensors(str(tmp_path))


# -- layouts and the replica cache ----------------------------------------------------------------
def test_engine_spec_and_server_info_give_the_same_layout():
    assert parse_engine_spec("tp=8,ep=8,dp_attention=8,moe-runner-backend=triton,enable_dp_lm_head=true") == {
        "tp_size": 8, "ep_size": 8, "attn_dp_size": 8, "moe_runner_backend": "triton", "enable_dp_lm_head": True}
    spec = EngineLayout.parse("tp=8,ep=8,dp_attention=8")
    # the deprecated spelling, plus args that do not change bytes
    info = {"tp_size": 8, "ep_size": 8, "dp_size": 8, "enable_dp_attention": True, "port": 1, "host": "h", "log_level": "info"}
    assert EngineLayout.from_server_info(info) == spec
    assert EngineLayout.from_server_info(info).key == spec.key
    assert spec != EngineLayout.parse("tp=8,ep=8")
    assert spec.describe() == "tp=8,ep=8,dp_attention=8"
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse_engine_spec("tp=2,ep")


def test_second_build_of_a_layout_reuses_it_and_another_layout_does_not(configs):
    replicas = ModelReplicas(cache_dir="")
    a = replicas.get(configs("qwen3_moe"), EngineLayout.parse("tp=2,ep=2"), 0)
    assert replicas.get(configs("qwen3_moe"), EngineLayout.from_server_info({"tp_size": 2, "ep_size": 2, "port": 9}), 0) is a
    assert replicas.builds == 1
    b = replicas.get(configs("qwen3_moe"), EngineLayout.parse("tp=2"), 0)
    c = replicas.get(configs("qwen3_moe"), EngineLayout.parse("tp=2,ep=2"), 1)
    assert len({id(a), id(b), id(c)}) == 3 and replicas.builds == 3 and len(replicas) == 3


def test_disk_cache_skips_the_probe_and_still_loads_exact_bytes(configs, tmp_path):
    engine = EngineLayout.parse("tp=2,ep=2")
    first = ModelReplicas(cache_dir=str(tmp_path))
    built = first.get(configs("qwen3_moe"), engine, 1)
    assert first.builds == 1 and len(list(tmp_path.iterdir())) == 1
    second = ModelReplicas(cache_dir=str(tmp_path))
    cached = second.get(configs("qwen3_moe"), engine, 1)
    assert second.builds == 0 and second.disk_hits == 1
    assert cached._model is None  # the meta model waits for the first group
    assert cached.mapping.sources == built.mapping.sources
    assert [g.regions for g in cached.groups] == [g.regions for g in built.groups]
    result = compare_with_reference(cached, reference_model(configs("qwen3_moe"), engine, 1))
    assert result.equal and result.params_checked == len(cached.param_specs)
    # another layout is another cache entry
    ModelReplicas(cache_dir=str(tmp_path)).get(configs("qwen3_moe"), EngineLayout.parse("tp=2"), 1)
    assert len(list(tmp_path.iterdir())) == 2


def test_process_wide_replicas_are_one_instance():
    from p2pweights.replica import model_replicas

    assert model_replicas() is model_replicas()
    assert isinstance(model_replicas(), ModelReplicas)


# -- the CLI ----------------------------------------------------------------------------------------
def test_check_layout_cli_json(configs, capsys):
    rc = main(["check-layout", "--model", configs("qwen3_moe"), "--engine", "tp=2,ep=2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["equal"] is True
    assert [r["rank"] for r in out["ranks"]] == [0, 1] and out["mismatches"] == []
    assert out["params_checked"] == sum(r["params_checked"] for r in out["ranks"]) > 0


def test_check_layout_cli_text_one_rank(configs, capsys):
    rc = main(["check-layout", "--model", configs("deepseek_v3"), "--engine", "tp=4,ep=4,dp_attention=4", "--rank", "3"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.splitlines()[0].startswith("rank 3: ") and "equal" in out and "OK, byte-exact over 1 rank(s)" in out


def test_check_layout_cli_reports_mismatches_with_a_failing_exit_code(configs, capsys, monkeypatch):
    real = ModelReplica.load_group

    def corrupt(self, group, hf_tensors, slot, offset=0):
        regions = real(self, group, hf_tensors, slot, offset)
        if regions[0].param_name == "model.layers.1.mlp.down_proj.weight":
            slot[regions[0].offset] ^= 0xFF
        return regions

    monkeypatch.setattr(ModelReplica, "load_group", corrupt)
    rc = main(["check-layout", "--model", configs("qwen3"), "--engine", "tp=2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc != 0 and out["equal"] is False
    assert out["mismatches"] == [
        "rank 0: model.layers.1.mlp.down_proj.weight: 1 of 6144 bytes differ",
        "rank 1: model.layers.1.mlp.down_proj.weight: 1 of 6144 bytes differ",
    ]


def test_check_layout_cli_rejects_unsupported_flags(configs, capsys):
    rc = main(["check-layout", "--model", configs("qwen3_moe"), "--engine", "tp=2,ep=2,enable_eplb=true"])
    assert rc == 2 and "enable_eplb" in capsys.readouterr().err


@pytest.mark.parametrize("model,spec", [("qwen3_moe", "tp=2,ep=2"), ("deepseek_v3", "tp=2,enforce_shared_experts_fusion=true"),
                                        ("glm4_moe", "tp=2")])
def test_update_session_restore_and_postprocess_leave_supported_layouts_unchanged(configs, model, spec):
    reference = reference_model(configs(model), EngineLayout.parse(spec), 1)
    before = {n: (p, p.detach().clone()) for n, p in reference.named_parameters()}
    sglang_env.run_update_session_hooks(reference)
    after = dict(reference.named_parameters())
    assert after.keys() == before.keys()
    for name, (param, data) in before.items():
        assert after[name] is param and torch.equal(after[name].detach(), data), name
