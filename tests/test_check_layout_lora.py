"""``p2pweights check-layout --lora``: the replica's adapter slot bytes held to sglang's own adapter load, as a command.

Run in-process through ``p2pweights.cli.main`` on the tiny Qwen3 (tests/replica_configs.py). The
reference is sglang's own code on each rank (replica/lora_reference.py): the rank's real CPU model,
``LoRAManager``, ``load_lora_adapter`` of PEFT files and ``fetch_new_loras``. The vLLM case is in
tests/test_vllm_lora.py (the vLLM suite).
"""
from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("sglang")
pytest.importorskip("safetensors")

from p2pweights.cli import main  # noqa: E402
from p2pweights.replica import lora_reference  # noqa: E402
from replica_configs import write_config  # noqa: E402


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    return write_config("qwen3", str(tmp_path_factory.mktemp("qwen3_check_lora")))


def test_every_rank_of_tp2_is_byte_exact_against_sglangs_own_adapter_load(config_dir, capsys):
    rc = main(["check-layout", "--model", config_dir, "--engine", "tp=2", "--lora", "4", "--max-loras-per-batch", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    # rank, buffers (2 layers x 4 modules x A/B), slot bytes (docs/lora.md's tp=2 numbers), slots 1 and 2, equal
    assert [row[:5] for row in rows] == [["0", "16", "22,016", "1,2", "yes"], ["1", "16", "22,016", "1,2", "yes"]], out
    assert "tp=2: OK, byte-exact over 2 rank(s)" in out


def test_json_names_the_adapter_and_every_rank(config_dir, capsys):
    rc = main(["check-layout", "--model", config_dir, "--engine", "tp=2", "--lora", "2,q,v,down", "--rank", "1",
               "--json"])
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and result["equal"], result
    assert result["lora"]["targets"] == ["q_proj", "v_proj", "down_proj"] and result["lora"]["r"] == 2
    assert "--max-lora-rank 8" in result["lora"]["flags"]  # the default: the smallest of vLLM's ranks that holds R
    (rank,) = result["ranks"]
    assert (rank["rank"], rank["slots"], rank["equal"], rank["first_difference"]) == (1, [1], True, None)
    # q, v -> qkv_proj; down_proj: 2 layers x 2 modules x A/B
    assert rank["buffers"] == 8


def test_a_byte_the_engine_holds_differently_fails_naming_slot_and_buffer(config_dir, capsys, monkeypatch):
    loads = lora_reference.engine_loads

    def loads_then_flip(manager, context, name, path):
        slot = loads(manager, context, name, path)
        manager.memory_pool.B_buffer["down_proj"][1][slot].view(-1)[3] += 1
        return slot

    monkeypatch.setattr(lora_reference, "engine_loads", loads_then_flip)
    rc = main(["check-layout", "--model", config_dir, "--engine", "tp=2", "--lora", "4", "--rank", "0"])
    out = capsys.readouterr().out
    assert rc == 1, out
    assert "NO (1): slot 1 lora.B.down_proj.L1" in out and "FAILED" in out


@pytest.mark.parametrize("flags, words", [
    (["--lora", "16", "--max-lora-rank", "8"], ["'random-r16'", "r=16", "--max-lora-rank 16"]),
    (["--lora", "4", "--lora-target-modules", "q_proj", "k_proj", "v_proj"], ["adapts module", "--lora-target-modules"]),
    (["--lora", "4,qq"], ["unknown target 'qq'"]),
    (["--lora", "4", "--max-loras-per-batch", "1"], ["slot 0 is the base model's"]),
    (["--max-lora-rank", "8"], ["--max-lora-rank needs --lora"]),
])
def test_a_refusal_is_one_line_and_exit_code_2(config_dir, capsys, flags, words):
    rc = main(["check-layout", "--model", config_dir, "--engine", "tp=2", *flags])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == "", captured
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("p2pweights check-layout: error: "), captured.err
    assert all(w in lines[0] for w in words), lines[0]
