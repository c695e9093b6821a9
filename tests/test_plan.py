"""The engine-rank assignment rule, the CLI and its errors (pure Python, no sglang)."""
from __future__ import annotations

import json
import re
from collections import Counter, defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import BENCH_MODELS, shared_model
from p2pweights.cli import main
from p2pweights.models import stage_layers
from p2pweights.models.engine_layout import EngineLayout
from p2pweights.models.shapes import PlanError
from p2pweights.planner.assign import Engine, TrainerLayout, assign_engine_ranks, make_plan

layout = EngineLayout.parse

QWEN3_235B = str(BENCH_MODELS / "qwen3-235b-a22b")


def engines_of(sizes, ep_equals_tp=False):
    return [Engine(g, layout(f"tp={g},ep={g if ep_equals_tp else 1}")) for g in sizes]


cluster = st.tuples(
    st.integers(min_value=1, max_value=70),  # senders
    st.lists(st.integers(min_value=1, max_value=16), min_size=1, max_size=12),  # engine GPU counts
)


@settings(max_examples=300, deadline=None)
@given(cluster)
def test_every_engine_rank_of_every_engine_has_exactly_one_sender(c):
    senders, sizes = c
    entries = assign_engine_ranks(senders, engines_of(sizes))
    written = Counter((engine, e.engine_rank) for e in entries for engine in e.engines)
    expected = {(i, r) for i, g in enumerate(sizes) for r in range(g)}
    assert set(written) == expected
    assert all(n == 1 for n in written.values())
    assert all(0 <= e.sender < senders for e in entries)


@settings(max_examples=300, deadline=None)
@given(cluster)
def test_first_targets_go_one_per_sender_in_order(c):
    senders, sizes = c
    entries = assign_engine_ranks(senders, engines_of(sizes))
    targets = [(i, r) for i, g in enumerate(sizes) for r in range(g)]
    owner = {(engine, e.engine_rank): e.sender for e in entries for engine in e.engines}
    for k, target in enumerate(targets[:senders]):
        assert owner[target] == k
    # so every sender writes when there are at least as many targets as senders
    assert len({e.sender for e in entries}) == min(senders, len(targets))


@settings(max_examples=300, deadline=None)
@given(cluster)
def test_a_sender_prepares_each_engine_rank_once_and_fans_out(c):
    senders, sizes = c
    entries = assign_engine_ranks(senders, engines_of(sizes))
    prepared = Counter((e.sender, e.layout, e.engine_rank) for e in entries)
    assert all(n == 1 for n in prepared.values())
    for e in entries:
        assert len(e.engines) == len(set(e.engines))  # an engine is written once per entry
        assert e.engines == sorted(e.engines)  # engines are visited in order


@settings(max_examples=300, deadline=None)
@given(cluster)
def test_remaining_targets_reuse_a_sender_of_the_same_engine_rank_with_fewest_engines(c):
    """Replays the targets after the first round: when some sender already prepares the engine
    rank, the target goes to one of them with the fewest writes; otherwise round robin."""
    senders, sizes = c
    engines = engines_of(sizes)
    entries = assign_engine_ranks(senders, engines)
    owner = {(engine, e.engine_rank): e.sender for e in entries for engine in e.engines}
    targets = [(i, r) for i, g in enumerate(sizes) for r in range(g)]
    writes = [0] * senders
    preparing: dict = defaultdict(set)
    round_robin = 0
    for k, (engine, rank) in enumerate(targets):
        key = (engines[engine].layout, rank)
        sender = owner[(engine, rank)]
        if k >= senders:
            if preparing[key]:
                fewest = min(writes[s] for s in preparing[key])
                assert sender in preparing[key] and writes[sender] == fewest
                assert sender == min(s for s in preparing[key] if writes[s] == fewest)
            else:
                assert sender == round_robin
                round_robin = (round_robin + 1) % senders
        writes[sender] += 1
        preparing[key].add(sender)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=10))
def test_engines_of_different_sizes_never_share_a_prepared_rank(senders, sizes):
    engines = engines_of(sizes, ep_equals_tp=True)
    for e in assign_engine_ranks(senders, engines):
        assert all(engines[i].layout == e.layout for i in e.engines)
        assert all(e.engine_rank < engines[i].gpus for i in e.engines)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 8), st.booleans(), st.lists(st.integers(1, 8), min_size=1, max_size=6))
def test_each_pp_stage_writes_every_engine_rank(pp, dp, gathered, sizes):
    trainer = TrainerLayout(gpus=pp * dp, pp=pp, pp_gathered=gathered)
    plan = make_plan(trainer, engines_of(sizes))
    written = Counter((stage, engine, e.engine_rank) for stage, e in plan.entries() for engine in e.engines)
    stages = 1 if gathered else pp
    assert set(written) == {(s, i, r) for s in range(stages) for i, g in enumerate(sizes) for r in range(g)}
    assert all(n == 1 for n in written.values())
    assert {e.sender for _, e in plan.entries()} <= set(range(trainer.senders_per_stage))


@given(st.integers(1, 200), st.integers(1, 200))
def test_stages_cover_every_layer_once_as_evenly_as_possible(layers, stages):
    if stages > layers:
        with pytest.raises(PlanError, match="--trainer: pp="):
            stage_layers(layers, stages)
        return
    bounds = stage_layers(layers, stages)
    assert bounds[0][0] == 0 and bounds[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [e - s for s, e in bounds]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes)


def test_qwen3_235b_on_two_engines_of_32_fans_each_sender_out_to_both_engines():
    plan = make_plan(TrainerLayout(gpus=64, tp=4, pp=4, ep=16), engines_of([32, 32], ep_equals_tp=True))
    # 16 senders per stage, 32 engine ranks: each sender prepares 2 ranks, each for both engines
    assert plan.active_senders_per_stage == 16
    assert plan.max_engine_ranks_per_sender == 2
    assert all(e.engines == [0, 1] for e in plan.per_stage)
    assert [e.engine_rank for e in plan.per_stage if e.sender == 3] == [3, 19]


def run_cli(capsys, *argv):
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_the_keys_the_issue_names(capsys):
    code, out, _ = run_cli(capsys, "--model", QWEN3_235B, "--trainer", "tp=4,pp=4,ep=16,gpus=64",
                           "--engines", "2x32", "--engine", "tp=32,ep=32", "--json")
    assert code == 0
    doc = json.loads(out)
    assert set(doc["cost"]) == {"bytes_per_engine_rank_max", "bytes_per_sender_max", "p2p_seconds",
                                "broadcast_seconds", "floor_seconds", "bottleneck",
                                "bytes_prepared_per_sender_max", "bytes_gathered_per_sender_max",
                                "production_seconds", "gather_seconds", "tensors_per_sender_max",
                                "host_path_seconds", "seconds_by_stage"}
    assert set(doc["links"]) == {"nic_gbps", "host_device_gbps", "slots", "production", "production_gbps",
                                 "production_measured", "gather_gbps", "host_us_per_tensor", "nics_per_node",
                                 "gpus_per_node", "nic_gbps_per_gpu"}
    assert doc["cost"]["seconds_by_stage"][doc["cost"]["bottleneck"]] == doc["cost"]["p2p_seconds"]
    assert all(set(s) == {"sender", "pp_stage", "engine_rank", "engines"} for s in doc["senders"])
    assert len(doc["senders"]) == 4 * 32  # 4 stages x 32 engine ranks, each prepared once per stage
    assert doc["cost"]["p2p_seconds"] >= doc["cost"]["floor_seconds"] > 0
    assert doc["cost"]["broadcast_seconds"] > doc["cost"]["p2p_seconds"]


def test_engines_list_with_different_gpu_counts(capsys):
    code, out, _ = run_cli(capsys, "--model", shared_model("qwen3-4b"), "--trainer", "tp=2,gpus=8",
                           "--engines", "3x4,1x2", "--json")
    assert code == 0
    doc = json.loads(out)
    assert [e["gpus"] for e in doc["engines"]] == [4, 4, 4, 2]
    written = sorted((eng, s["engine_rank"]) for s in doc["senders"] for eng in s["engines"])
    assert written == sorted([(i, r) for i in range(3) for r in range(4)] + [(3, 0), (3, 1)])


def test_text_output_names_the_bottleneck(capsys):
    code, out, _ = run_cli(capsys, "--model", shared_model("deepseek-v3"), "--trainer", "tp=8,pp=4,ep=32,gpus=256",
                           "--engines", "8x32", "--engine", "tp=32,ep=32", "--slots", "gpu", "--nic-gbps", "25")
    assert code == 0
    assert "bottleneck" in out and "NIC" in out and "sender host" not in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "@qwen3-4b", "--trainer", "gpus=0", "--engines", "1x2"], "--trainer: gpus=0"),
        (["--model", "@qwen3-4b", "--trainer", "gpus=8", "--engines", "2x0"], "--engines: '2x0'"),
        (["--model", "@qwen3-4b", "--trainer", "gpus=8", "--engines", "0x4"], "--engines: '0x4'"),
        (["--model", "@qwen3-4b", "--trainer", "tp=3,gpus=6", "--engines", "1x2"],
         "--trainer: tp=3 does not divide the 32 attention heads"),
        (["--model", "@qwen3-4b", "--trainer", "gpus=8", "--engines", "1x6"],
         "--engine: attention TP 6 .* does not divide the 32 attention heads"),
        (["--model", "@qwen3-0.6b", "--trainer", "pp=32,gpus=32", "--engines", "1x2"],
         "--trainer: pp=32 is more PP stages than the model's 28 layers"),
        (["--model", "@qwen3-4b", "--trainer", "gpus=8", "--engines", "1x4", "--engine", "tp=8"],
         "--engine: tp=8 but engine 0 has 4 GPUs"),
        (["--model", "@qwen3-4b", "--trainer", "gpus=8,cp=2", "--engines", "1x4"], "--trainer: cannot read 'cp=2'"),
        (["--model", "/nonexistent", "--trainer", "gpus=8", "--engines", "1x4"], "--model: no config.json"),
        (["--model", "@qwen3-4b", "--trainer", "tp=2,fsdp=3,gpus=8", "--engines", "1x4"],
         "--trainer: fsdp=3 does not divide the 4 data-parallel ranks"),
        (["--model", "@qwen3-4b", "--trainer", "gpus=8", "--engines", "1x4", "--production-gbps", "0"],
         "--production-gbps: 0 GB/s; bandwidths and rates must be positive"),
        (["--model", "@qwen3-4b", "--trainer", "gpus=8", "--engines", "1x4", "--gather-gbps", "-1"],
         "--gather-gbps: -1 GB/s"),
        (["--model", "@qwen3-4b", "--trainer", "gpus=8", "--engines", "1x4", "--nic-gbps", "0"],
         "--nic-gbps: 0 GB/s"),
    ],
)
def test_bad_requests_fail_with_an_error_naming_the_flag(capsys, argv, message):
    argv = [shared_model(a[1:]) if a.startswith("@") else a for a in argv]  # "@NAME": that model's folder
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert re.search(message, err), err


def test_unknown_architecture_names_the_supported_ones(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"]}))
    code, _, err = run_cli(capsys, "--model", str(tmp_path), "--trainer", "gpus=8", "--engines", "1x4")
    assert code == 2
    assert "--model: unknown architecture 'MambaForCausalLM'" in err and "Qwen3ForCausalLM" in err


def test_errors_are_value_errors_for_library_callers():
    with pytest.raises(ValueError, match="--trainer: gpus=0"):
        make_plan(TrainerLayout(gpus=0), engines_of([2]))


@settings(max_examples=200, deadline=None)
@given(cluster, st.booleans())
def test_balanced_rule_writes_each_engine_rank_once_and_caps_every_sender(c, mixed):
    senders, sizes = c
    engines = [Engine(g, layout(f"tp={g},ep={g if (mixed and i % 2) else 1}")) for i, g in enumerate(sizes)]
    entries = assign_engine_ranks(senders, engines, balanced=True)
    written = Counter((engine, e.engine_rank) for e in entries for engine in e.engines)
    assert set(written) == {(i, r) for i, g in enumerate(sizes) for r in range(g)}
    assert all(n == 1 for n in written.values())
    per_sender = Counter()
    for e in entries:
        per_sender[e.sender] += len(e.engines)
    limit = -(-sum(sizes) // senders)
    assert max(per_sender.values()) <= limit


def test_balanced_rule_fixes_the_pile_up_of_mixed_layouts():
    engines = [Engine(4, layout("tp=4,ep=1"))] * 100 + [Engine(8, layout("tp=8,ep=8"))] * 75
    plain = Counter()
    for e in assign_engine_ranks(200, engines):
        plain[e.sender] += len(e.engines)
    balanced = Counter()
    for e in assign_engine_ranks(200, engines, balanced=True):
        balanced[e.sender] += len(e.engines)
    assert max(plain.values()) > 50  # the plain rule piles writes on a few senders
    assert max(balanced.values()) <= -(-(100 * 4 + 75 * 8) // 200)
