"""One layout type and one --engine parser for every command; a key a command cannot honour is an
error naming the key and the command, never dropped (pure Python, no sglang)."""
from __future__ import annotations

import pytest

from p2pweights.cli import main
from p2pweights.commands.plan import parse_engines
from p2pweights.models.engine_layout import EngineLayout, LayoutSpecError, parse_layout_spec
from p2pweights.models.shapes import PlanError


def test_one_spelling_means_one_layout_in_every_command():
    dp = EngineLayout.parse("tp=4,ep=tp,dp=2,dp_lm_head=1,fused_shared_experts=1")
    assert dp == EngineLayout.parse("tp=4,ep=4,dp_attention=2,enable_dp_lm_head=true,enforce_shared_experts_fusion=true")
    assert (dp.tp, dp.ep, dp.attn_dp, dp.attn_tp, dp.moe_tp, dp.world_size) == (4, 4, 2, 2, 1, 4)
    assert dp.dp_lm_head and dp.shared_experts_fusion is True
    assert EngineLayout.parse("tp=2,fused_shared_experts=0").shared_experts_fusion is False
    assert EngineLayout.parse("tp=2").shared_experts_fusion is None
    # the deprecated sglang spelling of attention DP, as an engine reports it
    assert EngineLayout.from_server_info({"tp_size": 4, "ep_size": 4, "dp_size": 2, "enable_dp_attention": True,
                                          "enable_dp_lm_head": True, "enforce_shared_experts_fusion": True}) == dp
    # plan builds the same type from the same parser
    (engine,) = parse_engines("1x4", "ep=tp,dp=2,dp_lm_head=1,fused_shared_experts=1")
    assert engine.layout == dp


@pytest.mark.parametrize("spec, words", [
    ("tp=2,ep", "NAME=VALUE"),
    ("tp=two", "tp='two' is not a whole number"),
    ("tp=8,ep=3", "ep=3 must divide tp=8"),
    ("tp=8,dp=3", "dp=3 must divide tp=8"),
])
def test_a_spec_that_cannot_describe_an_engine_is_refused(spec, words):
    with pytest.raises(ValueError, match=words):
        EngineLayout.parse(spec)


def test_the_parser_refuses_keys_outside_what_the_command_honours():
    with pytest.raises(LayoutSpecError, match=r"--engine moe_runner_backend=triton: plan cannot honour it"):
        parse_layout_spec("tp=2,moe_runner_backend=triton", command="plan", honours={"tp_size"})
    assert parse_layout_spec("tp=2,moe_runner_backend=triton", command="check-layout") == {
        "tp_size": 2, "moe_runner_backend": "triton"}


# -- each command's refusals ---------------------------------------------------------------------------
PLAN = ["plan", "--model", "qwen3-30b-a3b", "--trainer", "gpus=8", "--engines", "2x4"]


@pytest.mark.parametrize("engine, key", [
    ("ep=4,moe_runner_backend=triton", "moe_runner_backend=triton"),  # bytes plan's cost model does not model
    ("pp=2", "pp=2"),  # engine pipeline parallelism
    ("dp_size=2", "dp_size=2"),  # sglang's plain DP: replicas, not a layout
])
def test_plan_refuses_an_engine_key_it_cannot_honour(capsys, engine, key):
    assert main([*PLAN, "--engine", engine]) == 2
    err = capsys.readouterr().err
    assert f"--engine {key}: plan cannot honour it" in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def no_check_rank(monkeypatch):
    """check-layout must refuse before it checks anything."""
    import p2pweights.replica.check as check

    def refuse(*args, **kwargs):
        raise AssertionError("check-layout ran a check on a spec it should have refused")

    monkeypatch.setattr(check, "check_rank", refuse)


@pytest.mark.parametrize("engine, key", [
    ("tp=2,dp_size=2", "dp_size=2"),  # used to be dropped: a tp=2 check that claimed to be the engine's
    ("tp=2,mem_fraction_static=0.8", "mem_fraction_static=0.8"),  # no effect on bytes: the replica ignores it
    ("tp=2,moe_runnr_backend=triton", "moe_runnr_backend=triton"),  # a typo used to vanish
])
def test_check_layout_refuses_an_engine_key_it_cannot_honour(no_check_rank, capsys, engine, key):
    assert main(["check-layout", "--model", "qwen3-0.6b", "--engine", engine]) == 2
    err = capsys.readouterr().err
    assert f"--engine {key}: check-layout cannot honour it" in err and len(err.strip().splitlines()) == 1


@pytest.fixture
def no_engines(monkeypatch):
    """demo must refuse before it starts any engine."""
    import p2pweights.commands.demo_run as demo_run

    def refuse(*args, **kwargs):
        raise AssertionError("demo started engines for a spec it should have refused")

    monkeypatch.setattr(demo_run, "run_demo", refuse)


@pytest.mark.parametrize("engine, key", [
    ("tp=2,dp_size=2", "dp_size=2"),
    ("tp=2,mem_fraction_static=0.8", "mem_fraction_static=0.8"),
])
def test_demo_refuses_an_engine_key_it_cannot_honour(no_engines, capsys, engine, key):
    assert main(["demo", "--engine", engine]) == 2
    err = capsys.readouterr().err
    assert f"--engine {key}: demo cannot honour it" in err and len(err.strip().splitlines()) == 1


def test_plan_and_check_layout_read_dp_as_attention_dp(monkeypatch, capsys):
    """``dp`` used to be attention DP in plan and silently nothing in check-layout and demo."""
    import p2pweights.replica.check as check

    seen = []
    monkeypatch.setattr(check, "check_rank", lambda config, engine, rank, **kw: seen.append(engine) or _Equal())
    assert main(["check-layout", "--model", "qwen3-0.6b", "--engine", "tp=4,dp=2", "--rank", "0", "--json"]) == 0
    (engine,) = parse_engines("1x4", "dp=2")
    assert seen == [engine.layout] and engine.layout.attn_tp == 2


class _Equal:
    rank = params_checked = bytes_checked = groups = largest_group_bytes = 0
    seconds, equal, mismatches = 0.0, True, []

    def to_json(self):
        return {"rank": 0}


def test_plan_errors_stay_value_errors_naming_the_flag():
    with pytest.raises(PlanError, match="--engine moe_runner_backend=triton: plan cannot honour it"):
        parse_engines("1x4", "moe_runner_backend=triton")
