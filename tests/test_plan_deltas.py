"""`p2pweights plan --changed-fraction`: delta updates predicted next to the full one (pure Python).

The bytes on the wire are the full update's scaled by the codec's expected ratio (or the share that
fits the delta area, the rest in full); every other stage of the full update stays; change
detection joins the pipeline and the apply follows the writes; the sender's bases cost a copy of
what it prepares.
"""
from __future__ import annotations

import json
import re

import pytest

from conftest import BENCH_MODELS
from p2pweights.cli import main
from p2pweights.deltas.expected import expected_ratio
from p2pweights.planner.cost import ENGINE_NIC, SENDER_NIC
from p2pweights.planner.delta_cost import APPLY_BESIDE, APPLY_TAIL, ENGINE_APPLY, SENDER_DETECT, SLOT_BYTES

QWEN3_235B = ["--model", str(BENCH_MODELS / "qwen3-235b-a22b"), "--trainer", "tp=4,pp=4,ep=16,gpus=64",
              "--engines", "2x32", "--engine", "tp=32,ep=32"]


def plan(capsys, *argv):
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def plan_json(capsys, *argv):
    code, out, err = plan(capsys, *QWEN3_235B, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_without_the_flag_the_plan_has_no_delta_section(capsys):
    assert "delta" not in plan_json(capsys)
    code, out, _ = plan(capsys, *QWEN3_235B)
    assert code == 0 and "delta updates" not in out


@pytest.mark.parametrize("apply", ["beside", "at end"])
def test_wire_bytes_scale_by_the_expected_ratio_and_the_other_stages_stay(capsys, apply):
    """The apply beside the writes (the default) is one more pipeline stage, and only the last slot's
    records are left after the last write; at the end (--apply-at-end) it follows every write."""
    at_end = ["--apply-at-end"] if apply == "at end" else []
    doc = plan_json(capsys, "--changed-fraction", "0.01,0.03", "--changed-fraction", "0.001", *at_end)
    cost, delta = doc["cost"], doc["delta"]
    assert [u["changed_fraction"] for u in delta["updates"]] == [0.01, 0.03, 0.001]
    assert delta["unit"] == 2 and delta["full_p2p_seconds"] == cost["p2p_seconds"]
    for u in delta["updates"]:
        r = expected_ratio(u["changed_fraction"], 2)
        assert u["codec_ratio"] == r == u["wire_ratio"]  # below the area's eighth: every record fits
        assert u["bytes_per_engine_rank_max"] == round(cost["bytes_per_engine_rank_max"] * r)
        assert u["bytes_per_sender_max"] == round(cost["bytes_per_sender_max"] * r)
        stages, full = u["seconds_by_stage"], cost["seconds_by_stage"]
        for link, seconds in full.items():
            want = seconds * r if link in (ENGINE_NIC, SENDER_NIC) else seconds
            assert stages[link] == pytest.approx(want)
        assert stages[SENDER_DETECT] == pytest.approx(cost["bytes_prepared_per_sender_max"] / 3.4e9)
        whole = cost["bytes_per_engine_rank_max"] / 6.4e9
        assert u["apply_seconds"] == pytest.approx(whole)
        if at_end:
            assert stages[ENGINE_APPLY] == pytest.approx(whole) and APPLY_BESIDE not in stages
            pipeline = max(v for k, v in stages.items() if k != ENGINE_APPLY)
            assert u["p2p_seconds"] == pytest.approx(pipeline + whole)
            continue
        last = min(SLOT_BYTES, cost["bytes_per_engine_rank_max"]) / 6.4e9
        assert stages[APPLY_BESIDE] == pytest.approx(whole) and stages[APPLY_TAIL] == pytest.approx(last)
        assert ENGINE_APPLY not in stages and u["apply_after_writes_seconds"] == pytest.approx(last) and last < whole
        pipeline = max(v for k, v in stages.items() if k != APPLY_TAIL)
        assert u["p2p_seconds"] == pytest.approx(pipeline + last)
    # a sparser update moves fewer bytes
    assert delta["updates"][2]["bytes_per_sender_max"] < delta["updates"][0]["bytes_per_sender_max"]


def test_records_past_the_delta_area_go_as_full_writes(capsys):
    small = plan_json(capsys, "--changed-fraction", "0.1")["delta"]["updates"][0]
    r = small["codec_ratio"]
    assert r > 1 / 8  # 0.19: the default area holds 1/8 of a rank's bytes
    assert small["delta_share"] == pytest.approx((1 / 8) / r)
    assert small["wire_ratio"] == pytest.approx(1 / 8 + 1 - (1 / 8) / r)
    roomy = plan_json(capsys, "--changed-fraction", "0.1", "--delta-area", "0.25")["delta"]["updates"][0]
    assert roomy["wire_ratio"] == roomy["codec_ratio"] == r and roomy["delta_share"] == 1.0


def test_nothing_changed_writes_nothing_and_everything_changed_writes_in_full(capsys):
    none, every = plan_json(capsys, "--changed-fraction", "0,1")["delta"]["updates"]
    assert none["wire_ratio"] == 0 and none["bytes_per_sender_max"] == 0 and none["apply_seconds"] == 0
    assert every["wire_ratio"] == 1.0 and every["apply_seconds"] == 0  # DENSE records: the usual writes


def test_fast_detection_and_apply_leave_the_full_update_bottleneck(capsys):
    """The sender still gathers, produces and copies every byte: a delta cannot beat those stages."""
    doc = plan_json(capsys, "--changed-fraction", "0.01", "--detect-gbps", "1e6", "--apply-gbps", "1e6")
    u = doc["delta"]["updates"][0]
    assert u["bottleneck"] == doc["cost"]["bottleneck"] == "trainer gather"
    assert u["p2p_seconds"] >= doc["cost"]["p2p_seconds"]


def test_slow_detection_or_apply_is_named_the_bottleneck(capsys):
    doc = plan_json(capsys, "--changed-fraction", "0.01", "--detect-gbps", "1")
    assert doc["delta"]["updates"][0]["bottleneck"] == SENDER_DETECT
    doc = plan_json(capsys, "--changed-fraction", "0.01", "--detect-gbps", "1e6", "--apply-gbps", "1")
    assert doc["delta"]["updates"][0]["bottleneck"] == APPLY_BESIDE
    doc = plan_json(capsys, "--changed-fraction", "0.01", "--detect-gbps", "1e6", "--apply-gbps", "1", "--apply-at-end")
    assert doc["delta"]["updates"][0]["bottleneck"] == ENGINE_APPLY


def test_sender_memory_for_bases_is_what_it_prepares(capsys):
    doc = plan_json(capsys, "--changed-fraction", "0.01")
    assert doc["delta"]["base_bytes_per_sender_max"] == doc["cost"]["bytes_prepared_per_sender_max"]
    assert doc["delta"]["area_bytes_per_engine_rank_max"] == round(doc["cost"]["bytes_per_engine_rank_max"] / 8)


def test_text_output_says_the_first_update_is_full_and_prints_every_fraction(capsys):
    code, out, _ = plan(capsys, *QWEN3_235B, "--changed-fraction", "0.01,0.03,0.1")
    assert code == 0
    assert "the first update after connect is always full" in out
    assert re.search(r"quantity\s+full\s+F=0\.01\s+F=0\.03\s+F=0\.1\n", out)
    assert re.search(r"sender memory for bases \(max\)\s+7\.679 GB", out)  # = bytes prepared per sender
    assert "default rates measured at 1% changed" in out
    assert "- sglang servers: their ranks publish a delta area only with" in out
    assert "PP stages" not in out  # built: each stage writes its own part of every engine rank's area


def test_the_plan_names_what_it_assumes_that_is_not_built(capsys):
    doc = plan_json(capsys, "--changed-fraction", "0.01", "--slots", "gpu")
    assert [w.split(":")[0] for w in doc["delta"]["not_built"]] == ["sglang servers"]  # PP stages take deltas


def test_fp8_weights_are_compared_byte_by_byte(capsys):
    code, out, err = plan(capsys, "--model", "kimi-k2-fp8", "--trainer", "tp=8,pp=8,ep=8,gpus=512",
                          "--engines", "16x8", "--engine", "tp=8,ep=8,dp=8", "--changed-fraction", "0.01", "--json")
    assert code == 0, err
    delta = json.loads(out)["delta"]
    assert delta["unit"] == 1 and delta["updates"][0]["codec_ratio"] == expected_ratio(0.01, 1)


@pytest.mark.parametrize("argv, message", [
    (["--changed-fraction", "1.5"], "--changed-fraction: 1.5 is outside"),
    (["--changed-fraction", "abc"], "--changed-fraction: 'abc' is not a number"),
    (["--changed-fraction", ","], "--changed-fraction: no fraction given"),
    (["--changed-fraction", "0.01", "--detect-gbps", "0"], "--detect-gbps: 0; must be positive"),
    (["--changed-fraction", "0.01", "--apply-gbps", "-2"], "--apply-gbps: -2"),
    (["--changed-fraction", "0.01", "--delta-area", "0"], "--delta-area: 0"),
])
def test_bad_delta_flags_fail_naming_the_flag(capsys, argv, message):
    code, out, err = plan(capsys, *QWEN3_235B, *argv)
    assert code == 2 and out == ""
    assert message in err, err
