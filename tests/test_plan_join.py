"""`p2pweights plan --join N` (issue "Elastic engine sets", item 3): the update in which N more
engines join (they are written in full, the kept ones go on) and a full update of the larger set."""
from __future__ import annotations

import json

from p2pweights.cli import main

QWEN3_235B = ["--model", "qwen3-235b-a22b", "--trainer", "tp=4,pp=2,ep=8,gpus=128", "--engines", "8x8",
              "--engine", "tp=8,ep=8", "--nics-per-node", "8", "--nic-gbps", "50"]


def plan(capsys, *argv):
    code = main(["plan", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def test_a_join_is_priced_between_its_bounds_and_the_larger_set_costs_at_least_the_kept_one(capsys):
    base = json.loads(plan(capsys, *QWEN3_235B, "--json"))
    doc = json.loads(plan(capsys, *QWEN3_235B, "--join", "4", "--json"))
    j = doc["join"]
    assert j["joining"] == 4 and j["gpus"] == 8
    assert j["kept_seconds"] == base["cost"]["p2p_seconds"]  # without --changed-fraction: the kept set in full
    assert j["join_seconds_min"] == max(j["kept_seconds"], j["new_alone_seconds"]) <= j["join_seconds_max"]
    assert j["join_seconds_max"] == j["kept_seconds"] + j["new_alone_seconds"]
    assert j["after_full_p2p_seconds"] >= j["kept_seconds"] > 0  # 12 engines cost at least what 8 do
    assert "join update" in plan(capsys, *QWEN3_235B, "--join", "4")


def test_a_join_beside_deltas_prices_the_kept_engines_at_the_first_fraction(capsys):
    doc = json.loads(plan(capsys, *QWEN3_235B, "--join", "1", "--changed-fraction", "0.01", "--json"))
    assert doc["join"]["kept_seconds"] == doc["delta"]["updates"][0]["p2p_seconds"]


def test_a_join_of_no_engines_is_refused_in_one_line(capsys):
    assert main(["plan", *QWEN3_235B, "--join", "-1"]) == 2
    assert "--join" in capsys.readouterr().err
