"""Speculative draft roles: an engine running a NEXTN / EAGLE draft holds the target's weights and
the draft's (the MTP layer of the same checkpoint); every role is built, checked and written.

Replica side: sglang's own draft class per family (DeepSeek-V3 NextN, GLM4-MoE NextN, GLM4-MoE-Lite
NextN, Qwen3-MoE MTP) on meta, its own loader probe, byte-exact against sglang's draft loading
the same random checkpoint; the draft's embedding and head are the target's. Sender side: the
roles of a rank joined, role-qualified names ("draft."), publication checks covering both roles.
End to end: a real engine with a draft role, updated over Mooncake, equal to sglang's loaders.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from p2pweights.errors import LayoutMismatch, UnknownParameter, UnsupportedLayout
from p2pweights.models.checkpoint import TensorSpec, checkpoint_tensors, random_tensor
from p2pweights.models.engine_layout import EngineLayout
from p2pweights.replica import ModelReplicas
from p2pweights.replica.draft_model import DRAFT_ARCHITECTURES
from p2pweights.replica.groups import ParameterGroup, SlotRegion
from p2pweights.replica.reference import reference_model
from p2pweights.replica.role_check import check_rank_roles, reference_draft
from p2pweights.replica.roles import RankRoles, _join_groups, rank_replica, roles_of
from p2pweights.transport.publication import EnginePublication, ParamTarget
from replica_configs import CONFIGS, MTP_CONFIGS, write_config

NEXTN = "speculative_algorithm=NEXTN"


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("draft_configs"))
    return {name: write_config(name, d) for name in (*MTP_CONFIGS, "glm4_moe", "qwen3")}


@pytest.fixture(scope="module")
def replicas():
    return ModelReplicas(cache_dir="")


def _mtp_prefix(name: str) -> str:
    cfg = CONFIGS[name]
    return "mtp." if cfg["model_type"] == "qwen3_moe" else f"model.layers.{cfg['num_hidden_layers']}."


# ---- the replica: one per role ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", MTP_CONFIGS)
def test_draft_role_is_byte_exact_for_each_family_at_tp2_ep2(configs, replicas, name):
    engine = EngineLayout.parse(f"tp=2,ep=2,{NEXTN}")
    for rank in (0, 1):
        checks = check_rank_roles(configs[name], engine, rank, seed=3, replicas=replicas)
        assert set(checks) == {"target", "draft"}
        for role, result in checks.items():
            assert result.equal, (role, result.mismatches)
            assert result.params_checked > 0
        draft = replicas.get(configs[name], engine, rank, role="draft")
        # the draft's checked parameters are exactly the draft replica's (nothing else was compared)
        assert checks["draft"].params_checked == len(draft.param_specs)


def test_a_draft_as_an_sglang_server_reports_it_is_a_draft_role_too(configs, replicas):
    """/server_info of sglang 0.5.23: NEXTN resolved to EAGLE, the draft path = the model path."""
    cfg = configs["qwen3_moe_mtp"]
    engine = EngineLayout.from_server_info({"tp_size": 2, "ep_size": 2, "speculative_algorithm": "EAGLE",
                                            "speculative_draft_model_path": "/models/q", "model_path": "/models/q",
                                            "speculative_num_steps": 3, "speculative_eagle_topk": 1})
    assert roles_of(cfg, engine) == ("target", "draft")
    checks = check_rank_roles(cfg, engine, 1, seed=8, replicas=replicas)
    assert all(c.equal and c.params_checked for c in checks.values()), checks["draft"].mismatches


def test_draft_role_is_byte_exact_with_dp_attention(configs, replicas):
    engine = EngineLayout.parse(f"tp=2,ep=2,dp_attention=2,{NEXTN}")
    checks = check_rank_roles(configs["deepseek_v3"], engine, 1, seed=5, replicas=replicas)
    assert checks["draft"].equal and checks["target"].equal, checks["draft"].mismatches


@pytest.mark.parametrize("name", MTP_CONFIGS)
def test_the_draft_is_sglangs_draft_class_loading_only_the_mtp_layer(configs, replicas, name):
    engine = EngineLayout.parse(f"tp=2,ep=2,{NEXTN}")
    draft = replicas.get(configs[name], engine, 0, role="draft")
    target = replicas.get(configs[name], engine, 0)
    assert type(draft.model).__name__ == DRAFT_ARCHITECTURES[CONFIGS[name]["architectures"][0]]
    prefix = _mtp_prefix(name)
    sources = {hf for names in draft.mapping.sources.values() for hf in names}
    assert sources and all(hf.startswith(prefix) for hf in sources), sorted(sources)[:5]
    # its loader skips the MTP layer's own embedding and head: the target's tensors are used instead
    assert not any("embed_tokens" in hf or "shared_head.head" in hf for hf in sources)
    assert not any("embed_tokens" in p or p == "lm_head.weight" for p in draft.param_specs)
    # and the target's loader skips the MTP layer: those names write nothing of the target
    mtp_names = [n for n in target.hf_specs if n.startswith(prefix)]
    assert mtp_names and set(mtp_names) <= target.ignored_hf_names


def test_a_draft_replica_from_the_disk_cache_rebuilds_the_draft_and_stays_byte_exact(configs, tmp_path):
    from p2pweights.replica.check import compare_with_reference

    cfg, engine = configs["qwen3_moe_mtp"], EngineLayout.parse(f"tp=2,ep=2,{NEXTN}")
    first = ModelReplicas(cache_dir=str(tmp_path)).get(cfg, engine, 1, role="draft")
    again = ModelReplicas(cache_dir=str(tmp_path))
    draft = again.get(cfg, engine, 1, role="draft")
    assert again.disk_hits == 1 and again.builds == 0 and draft.role == "draft"
    assert draft.param_specs == first.param_specs
    target = again.get(cfg, engine, 1)  # another role: another cache entry, never the draft's
    assert again.builds == 1 and set(target.param_specs).isdisjoint({"fc.weight", "pre_fc_norm_hidden.weight"})
    result = compare_with_reference(draft, reference_draft(cfg, engine, 1, seed=9), seed=9, config=cfg)
    assert result.equal and result.params_checked == len(draft.param_specs), result.mismatches


def test_the_receivers_draft_uses_the_targets_embedding_and_head_tensors(configs):
    from p2pweights.receiver.draft_role import DraftRole
    from p2pweights.receiver.region import place_parameters
    from p2pweights.replica import sglang_env

    cfg, engine = configs["glm4_moe_mtp"], EngineLayout.parse(f"tp=2,{NEXTN}")
    target = sglang_env.build_model(cfg, engine, 0)
    region = place_parameters(target)
    draft = DraftRole(cfg, engine, 0, target)
    assert draft.model.model.embed_tokens.weight is target.model.embed_tokens.weight
    assert draft.model.lm_head.weight is target.lm_head.weight
    assert sorted(draft.shared) == ["lm_head.weight", "model.embed_tokens.weight"]
    published = dict(draft.published())
    assert published and all(n.startswith("draft.") for n in published)
    assert not any("embed_tokens" in n or "lm_head" in n for n in published)
    # the draft's own parameters live in its own region, none in the target's
    lo, hi = region.address, region.address + region.nbytes
    assert all(not lo <= t.data_ptr() < hi for t in published.values())
    with pytest.raises(UnknownParameter, match=r"no draft parameter 'draft.model.embed_tokens.weight'"):
        draft.digest(["draft.model.embed_tokens.weight"], "e")


def test_an_engine_without_a_draft_keeps_its_target_only_replica(configs, replicas):
    engine = EngineLayout.parse("tp=2")
    replica = rank_replica(replicas, configs["glm4_moe_mtp"], engine, 0)
    assert not isinstance(replica, RankRoles) and replica.role == "target"
    assert replica.group_of("model.layers.2.eh_proj.weight") is None  # the MTP layer: ignored, not an error
    assert not any(n.startswith("draft.") for n in replica.param_specs)


def test_a_draft_the_replica_cannot_build_is_refused_with_the_reason(configs):
    with pytest.raises(UnsupportedLayout, match=r"Qwen3ForCausalLM is not supported.*DeepseekV3ForCausalLM"):
        roles_of(configs["qwen3"], EngineLayout.parse(f"tp=2,{NEXTN}"))
    with pytest.raises(UnsupportedLayout, match=r"0 MTP layer\(s\).*num_nextn_predict_layers must be 1") as info:
        roles_of(configs["glm4_moe"], EngineLayout.parse(f"tp=2,{NEXTN}"))
    assert info.value.parameter == "num_nextn_predict_layers"
    assert roles_of(configs["glm4_moe"], EngineLayout.parse("tp=2")) == ("target",)
    # NGRAM drafts have no weights: the engine holds the target's only
    assert roles_of(configs["glm4_moe"], EngineLayout.parse("tp=2,speculative_algorithm=NGRAM")) == ("target",)


# ---- the roles of one rank joined: what a sender prepares ------------------------------------------------


def test_the_roles_of_a_rank_load_into_one_slot_byte_exact_under_role_names(configs, replicas):
    cfg = configs["deepseek_v3"]
    engine = EngineLayout.parse(f"tp=2,{NEXTN}")
    roles = rank_replica(replicas, cfg, engine, 1)
    assert isinstance(roles, RankRoles) and set(roles.roles) == {"target", "draft"}
    assert rank_replica(replicas, cfg, engine, 1) is roles  # one per rank's role replicas: reconnects reuse it
    draft = roles.roles["draft"]
    assert set(roles.param_specs) == set(roles.roles["target"].param_specs) | {f"draft.{n}" for n in draft.param_specs}
    hf_of_groups = [n for g in roles.groups for n in g.hf_names]
    assert len(hf_of_groups) == len(set(hf_of_groups))  # each HF tensor staged once
    specs = checkpoint_tensors(cfg)
    want_target = dict(reference_model(cfg, engine, 1, seed=11).named_parameters())
    want_draft = dict(reference_draft(cfg, engine, 1, seed=11).named_parameters())
    slot = torch.full((roles.largest_group_nbytes * 2 + 256,), 0xAB, dtype=torch.uint8)
    seen = set()
    for group in roles.groups:
        inputs = {n: random_tensor(n, specs[n], 11) for n in group.hf_names}
        for r in roles.load_groups([(group, 256)], inputs, slot):
            role, own = ("draft", r.param_name[6:]) if r.param_name.startswith("draft.") else ("target", r.param_name)
            want = (want_draft if role == "draft" else want_target)[own]
            assert torch.equal(slot[r.offset:r.offset + r.nbytes], want.detach().contiguous().view(-1).view(torch.uint8)), \
                r.param_name
            seen.add(r.param_name)
    assert seen == set(roles.param_specs)  # every parameter of both roles written, under its role's name


class _StandInReplica:
    def __init__(self, groups):
        self.groups = groups
        self.calls = []

    def load_groups(self, placed, tensors, slot):
        self.calls.append(([(g.index, off) for g, off in placed], sorted(tensors)))
        return [SlotRegion(r.param_name, off + r.offset, r.nbytes) for g, off in placed for r in g.regions]


def _group(index, params, hf, nbytes=100):
    regions, offset = [], 0
    for p in params:
        regions.append(SlotRegion(p, offset, nbytes))
        offset += 256
    return ParameterGroup(index, tuple(params), tuple(hf), tuple(regions))


def test_role_groups_sharing_an_hf_input_are_joined_and_loaded_by_both_roles():
    """A tensor both roles load (storage the draft does not share) is one group: each role's
    loader gets it and writes its own region (written twice, same bytes)."""
    target = _StandInReplica([_group(0, ["a"], ["x"]), _group(1, ["b"], ["shared", "y"])])
    draft = _StandInReplica([_group(0, ["c"], ["shared"]), _group(1, ["d"], ["z"])])
    groups, members = _join_groups({"target": target, "draft": draft})
    joined = [g for g in groups if "shared" in g.hf_names]
    assert len(groups) == 3 and len(joined) == 1
    assert joined[0].params == ("b", "draft.c") and set(joined[0].hf_names) == {"shared", "y"}
    offsets = [r.offset for r in joined[0].regions]
    assert offsets[1] >= offsets[0] + 100 and offsets[1] % 256 == 0  # own bytes, no overlap
    roles = RankRoles.__new__(RankRoles)
    roles.roles, roles._members = {"target": target, "draft": draft}, members
    tensors = {"shared": 1, "y": 2}
    regions = roles.load_groups([(joined[0], 512)], tensors, slot=None)
    assert {r.param_name for r in regions} == {"b", "draft.c"}
    assert target.calls == [([(1, 512)], ["shared", "y"])] and draft.calls == [([(0, 512 + offsets[1])], ["shared"])]


def test_the_publication_check_covers_both_roles(configs, replicas):
    """At connect a sender compares the engine's table with every role's parameters: a draft entry
    missing, of another size or unknown to the draft replica is refused, naming it."""
    roles = rank_replica(replicas, configs["glm4_moe_mtp"], EngineLayout.parse(f"tp=2,ep=2,{NEXTN}"), 0)
    expected = {n: s.nbytes for n, s in roles.param_specs.items()}
    table, addr = {}, 1 << 20
    for n, nbytes in expected.items():
        table[n] = ParamTarget(addr, nbytes // 2, 2)
        addr += nbytes + 256
    EnginePublication("mooncake", "127.0.0.1:1", dict(table)).check_params(expected)
    name = next(n for n in expected if n.startswith("draft.model.decoder.mlp.experts"))
    missing = {k: v for k, v in table.items() if k != name}
    with pytest.raises(LayoutMismatch, match=rf"{name}: not published"):
        EnginePublication("mooncake", "127.0.0.1:1", missing).check_params(expected)
    resized = dict(table)
    resized[name] = ParamTarget(table[name].data_ptr, table[name].numel // 2, 2)
    with pytest.raises(LayoutMismatch, match=rf"{name}: published"):
        EnginePublication("mooncake", "127.0.0.1:1", resized).check_params(expected)
    extra = dict(table)
    extra["draft.model.embed_tokens.weight"] = ParamTarget(addr, 8, 2)  # the target's, never the draft's
    with pytest.raises(LayoutMismatch, match=r"draft.model.embed_tokens.weight: published, but"):
        EnginePublication("mooncake", "127.0.0.1:1", extra).check_params(expected)


def test_hf_specs_of_the_roles_must_agree():
    spec = TensorSpec((4,), "bfloat16")

    class R:
        def __init__(self, specs, role):
            self.hf_specs, self.param_specs, self.groups, self.ignored_hf_names = specs, {}, [], frozenset()
            self.engine, self.rank, self.key = EngineLayout.parse("tp=1"), 0, role

    with pytest.raises(LayoutMismatch, match="x: the roles"):
        RankRoles({"target": R({"x": spec}, "t"), "draft": R({"x": TensorSpec((4,), "float32")}, "d")})


# ---- check-layout: every role ------------------------------------------------------------------------------


def test_check_layout_json_reports_every_role(configs):
    cmd = [sys.executable, "-m", "p2pweights", "check-layout", "--model", configs["qwen3_moe_mtp"],
           "--engine", f"tp=2,ep=2,{NEXTN}", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout)
    assert result["equal"] is True and set(result["roles"]) == {"target", "draft"}
    for role in ("target", "draft"):
        assert result["roles"][role]["equal"] is True and result["roles"][role]["params_checked"] > 0
        assert [r["rank"] for r in result["roles"][role]["ranks"]] == [0, 1]
    assert result["params_checked"] == sum(r["params_checked"] for r in result["roles"].values())
    # without a draft: the target role only, as before
    out = subprocess.run(cmd[:-3] + ["--engine", "tp=2,ep=2", "--json", "--rank", "1"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and set(json.loads(out.stdout)["roles"]) == {"target"}, out.stderr[-2000:]


@pytest.mark.parametrize("name, words", [
    ("glm4_moe", "0 MTP layer(s)"),  # the family, but no MTP layer in the checkpoint
    ("qwen3", "Qwen3ForCausalLM is not supported"),  # its EAGLE draft is a separate checkpoint
])
def test_check_layout_refuses_a_draft_it_cannot_build_naming_why(configs, name, words):
    """Never ``equal: true`` having checked the target only: refused before any rank (exit 2)."""
    out = subprocess.run([sys.executable, "-m", "p2pweights", "check-layout", "--model", configs[name],
                          "--engine", f"tp=2,{NEXTN}", "--json"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 2 and words in out.stderr, out.stderr[-2000:]
    assert out.stdout == ""


def test_connect_refuses_an_engine_whose_draft_the_replica_cannot_build(configs, replicas):
    from p2pweights.sender import WeightSender

    sender = WeightSender(configs["glm4_moe"], transport="mooncake", replicas=replicas)
    try:
        with pytest.raises(UnsupportedLayout, match="num_nextn_predict_layers must be 1"):
            sender._prepare(EngineLayout.from_server_info({"tp_size": 2, "speculative_algorithm": "EAGLE"}), 0)
    finally:
        sender.close()


# ---- end to end: a real engine running a draft role -----------------------------------------------------


@pytest.fixture(scope="module")
def draft_engine(configs):
    from p2pweights.receiver import start_engine

    engine = start_engine(configs["glm4_moe_mtp"], f"tp=2,ep=2,{NEXTN}", transport="mooncake", name="mtp")
    yield engine
    engine.close()


def _update(sender, version, seed, specs, **kw):
    from p2pweights.models.checkpoint import random_checkpoint

    with sender.update(version, **kw) as update:
        for name, t in random_checkpoint(specs, seed):
            update.push(name, t)
    return update.report


def test_an_update_writes_the_draft_role_of_a_real_engine(configs, draft_engine):
    from p2pweights.control import SglangEngine
    from p2pweights.receiver import check_weights_equal
    from p2pweights.sender import WeightSender

    cfg = configs["glm4_moe_mtp"]
    client = SglangEngine(draft_engine.url, name="mtp")
    published = EnginePublication.from_json(client.transfer_engine_info(1))
    draft_names = [n for n in published.params if n.startswith("draft.")]
    assert "draft.model.decoder.mlp.experts.w13_weight" in draft_names
    assert "draft.model.embed_tokens.weight" not in published.params  # the target's, published once
    published.check_regions()  # the draft's region and the target's do not overlap
    name = "draft.model.eh_proj.weight"
    before = client.get_weights_by_name(name)
    specs = checkpoint_tensors(cfg)
    sender = WeightSender(cfg, transport="mooncake", buffer_size=1 << 20)
    try:
        sender.connect([client])
        assert isinstance(sender.prepared[0].replica, RankRoles)
        _update(sender, "v1", 21, specs)
        result = check_weights_equal(draft_engine.url, hf_seed=21)
        assert result["success"], result["message"]
        # the MTP layer's new weights are in the draft (it changed), and the check compared the draft
        after = client.get_weights_by_name(name)
        assert after is not None and after != before
        compared = sum(r["compared"] for r in result["ranks"])
        _update(sender, "v2", 22, specs, verify=True)  # the engine ranks digest both roles' parameters
        result = check_weights_equal(draft_engine.url, hf_seed=22)
        assert result["success"], result["message"]
        assert sum(r["compared"] for r in result["ranks"]) == compared
        # the check can fail: against another seed the draft's tensors differ too
        wrong = check_weights_equal(draft_engine.url, hf_seed=21)
        assert not wrong["success"]
        assert any(m["name"].startswith("draft.") for r in wrong["ranks"] for m in r["mismatches"])
    finally:
        sender.close()


def test_a_target_only_sender_is_refused_by_an_engine_running_a_draft(configs, draft_engine):
    """A sender that prepared the target's replica alone (what it did before draft roles) would leave
    the draft stale: the engine's published draft regions make connect refuse it, naming them."""
    from p2pweights.control import SglangEngine
    from p2pweights.replica import roles as roles_module
    from p2pweights.sender import WeightSender

    cfg = configs["glm4_moe_mtp"]
    sender = WeightSender(cfg, transport="mooncake", buffer_size=1 << 20)
    real = roles_module.rank_replica
    try:
        roles_module.rank_replica = lambda replicas, config, engine, rank, hf_specs=None: replicas.get(config, engine, rank)
        with pytest.raises(LayoutMismatch, match=r"draft\.model\..*published, but the sender's replica has no such"):
            sender.connect([SglangEngine(draft_engine.url, name="mtp")])
    finally:
        roles_module.rank_replica = real
        sender.close()


class _DoctoredDraft:
    """Poses as the real engine, but publishes a draft table that differs from the draft replica."""

    def __init__(self, url, change):
        from engine_proxy import PosingAs

        class Hooks(PosingAs):
            def transfer_engine_info(self, rank):
                peer, table = self.real.transfer_engine_info(rank)["remote_instance_transfer_engine_info"]
                return [peer, change(dict(table))]

        self.hooks = Hooks(url)


@pytest.mark.parametrize("change, why", [
    (lambda t: {k: v for k, v in t.items() if k != "draft.model.eh_proj.weight"},
     r"draft\.model\.eh_proj\.weight: not published"),
    (lambda t: {**t, "draft.model.eh_proj.weight": [t["draft.model.eh_proj.weight"][0],
                                                    t["draft.model.eh_proj.weight"][1] // 2, 2]},
     r"draft\.model\.eh_proj\.weight: published \d+ B, the sender's replica has \d+ B"),
    (lambda t: {k: v for k, v in t.items() if not k.startswith("draft.")},
     r"draft\..*: not published"),
])
def test_an_engine_publishing_a_draft_table_unlike_the_draft_replica_is_refused_at_connect(
        configs, draft_engine, change, why):
    from p2pweights.control import SglangEngine
    from p2pweights.receiver import ReceiverServer
    from p2pweights.sender import WeightSender

    server = ReceiverServer(_DoctoredDraft(draft_engine.url, change).hooks).start()
    sender = WeightSender(configs["glm4_moe_mtp"], transport="mooncake", buffer_size=1 << 20)
    try:
        with pytest.raises(LayoutMismatch, match=why):
            sender.connect([SglangEngine(server.url, name="doctored")])
        assert not sender.engines  # nothing attached
    finally:
        sender.close()
        server.close()


def test_the_demo_updates_engines_with_a_draft_role_by_p2p_and_by_broadcast(configs):
    """``p2pweights demo --engine tp=2,speculative_algorithm=NEXTN``: forked senders over NIXL, then
    sglang's broadcast path (every runner loads what the target received); both equal, draft included."""
    from p2pweights.commands.demo_run import results_json, run_demo

    results = run_demo(configs["deepseek_v3"], engines=1, engine=f"tp=2,{NEXTN}", senders=1, steps=1,
                       transport="nixl", modes=("p2p", "broadcast"), progress=lambda line: None)
    steps = results_json(results)["steps"]
    assert [(s["mode"], s["equal"]) for s in steps] == [("p2p", True), ("broadcast", True)]


# ---- DeepSeek-V3 NextN with FP8 block quantization (the target's quantization) -----------------------------


def test_an_fp8_draft_is_byte_exact_in_check_layout_and_after_an_update_quantized_on_send(replicas):
    from p2pweights.control import SglangEngine
    from p2pweights.models import resolve_model
    from p2pweights.models.checkpoint import random_checkpoint, trainer_tensors
    from p2pweights.receiver import check_weights_equal, start_engine
    from p2pweights.sender import WeightSender

    tiny = resolve_model("deepseek-v3-fp8-tiny")  # num_nextn_predict_layers 1, FP8 128x128 blocks
    engine = EngineLayout.parse(f"tp=2,{NEXTN}")
    checks = check_rank_roles(tiny, engine, 1, seed=2, replicas=replicas)
    assert checks["draft"].equal and checks["target"].equal, checks["draft"].mismatches
    assert checks["draft"].dtypes.get("float8_e4m3fn", 0) > 0  # the MTP layer's experts are FP8 too
    with start_engine(tiny, f"tp=2,{NEXTN}", transport="mooncake", name="fp8mtp") as e:
        sender = WeightSender(tiny, transport="mooncake", buffer_size=1 << 20, replicas=replicas)
        try:
            sender.connect([SglangEngine(e.url, name="fp8mtp")])
            with sender.update("v1") as update:  # BF16 trainer tensors, quantized on send for both roles
                for name, t in random_checkpoint(trainer_tensors(tiny), 4):
                    update.push(name, t)
            result = check_weights_equal(e.url, hf_seed=4)
            assert result["success"], result["message"]
            wrong = check_weights_equal(e.url, hf_seed=5)
            assert any(m["name"].startswith("draft.") for r in wrong["ranks"] for m in r["mismatches"])
        finally:
            sender.close()
