"""`check-layout --engine-kind vllm --lora`: the replica's adapter slot bytes against vLLM's own adapter load, as a command.

In the vLLM suite (conftest.VLLM_TESTS: a child pytest with ``.vllm_site`` on its path). Run
in-process through ``p2pweights.cli.main`` on the tiny Qwen3; the reference is vLLM's own worker
code on each rank (replica/vllm_lora_reference.py): the rank's real CPU model,
``create_lora_manager`` and ``add_adapter`` of PEFT files into every slot.
"""
from __future__ import annotations

import pytest

try:
    import vllm  # noqa: F401  (the platform is not resolved by this import)
except ImportError as e:  # the only reason to skip: docs/vllm.md says how to install it
    pytest.skip(f"vllm is not importable ({e}); install vllm 0.33.0 as docs/vllm.md says",
                allow_module_level=True)
pytest.importorskip("torch")
pytest.importorskip("safetensors")

from p2pweights.cli import main  # noqa: E402
from replica_configs import write_config  # noqa: E402

VLLM = ["check-layout", "--engine-kind", "vllm", "--engine", "tp=2"]


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    return write_config("qwen3", str(tmp_path_factory.mktemp("qwen3_vllm_check_lora")))


def test_every_slot_of_every_rank_of_tp2_is_byte_exact_against_vllms_own_adapter_load(config_dir, capsys):
    rc = main([*VLLM, "--model", config_dir, "--lora", "4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["0"], ["1"])]
    # rank, tensors (2 layers x 7 slices x A/B), slot bytes (docs/lora.md's tp=2 numbers), slots 0 and 1, equal
    assert [row[:5] for row in rows] == [["0", "28", "22,016", "0,1", "yes"], ["1", "28", "22,016", "0,1", "yes"]], out
    assert "--max-lora-rank 8 --max-loras 2" in out and "vllm:tp=2: OK, byte-exact over 2 rank(s)" in out


@pytest.mark.parametrize("flags, words", [
    (["--lora", "4", "--lora-target-modules", "qkv_proj"], ["adapts module", "vLLM would leave"]),
    (["--lora", "4", "--max-lora-rank", "12"], ["vLLM refuses", "--max-lora-rank 12"]),
])
def test_a_refusal_is_one_line_and_exit_code_2(config_dir, capsys, flags, words):
    rc = main([*VLLM, "--model", config_dir, *flags])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == "", captured
    lines = [line for line in captured.err.strip().splitlines() if line.startswith("p2pweights")]
    assert len(lines) == 1 and lines[0].startswith("p2pweights check-layout: error: "), captured.err
    assert all(w in lines[0] for w in words), lines[0]
