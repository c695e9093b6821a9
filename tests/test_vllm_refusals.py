"""vLLM's own refusals read as refusals (replica/vllm_refusals.py): a DeepSeek-style config whose MLA head
dims no MLA prefill backend of vLLM 0.33 takes on Hopper is refused in one line naming vLLM's reason
and that the limit is vLLM's, exit code 2, both by check-layout and where a replica is built (the
sender's path), instead of failing deep in the replica. Commands run in child processes that find
.vllm_site themselves (tests/test_vllm_site.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from conftest import ROOT, VLLM_SITE
from p2pweights.replica.vllm_layout import VllmLayout
from p2pweights.replica.vllm_refusals import is_mla_prefill_refusal, mla_prefill_refusal
from replica_configs import CONFIGS, write_config

USING = "p2pweights: vLLM is not importable in this Python; using vLLM "  # vllm_site's line (the child's only other)
SPEC = "tp=1,deep_gemm=0,moe_backend=triton"
VLLM_SAYS = ("No valid MLA prefill backend found with MLAPrefillSelectorConfig(dtype=torch.bfloat16, "
             "mla_dimensions=(qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)). Reasons: {FLASH_ATTN: "
             "[Model does not have supported MLA dimensions (got (qk_nope_head_dim=16, qk_rope_head_dim=8, "
             "v_head_dim=16))]}.")


def child_env() -> dict[str, str]:
    """No P2PW_VLLM_SITE and no .vllm_site on PYTHONPATH (this process's p2pweights: CI's installed
    wheel, or the source PYTHONPATH names): the command finds .vllm_site itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "P2PW_VLLM_SITE")}
    kept = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and ".vllm_site" not in p]
    return {**env, **({"PYTHONPATH": os.pathsep.join(kept)} if kept else {})}


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(USING)]


def _assert_reads_as_vllms_refusal(line: str) -> None:
    for said in ("vLLM engine vllm:tp=1,moe_backend=triton,deep_gemm=0: vLLM 0.33 itself refuses this model: "
                 "No valid MLA prefill backend found with", "(qk_nope, qk_rope, v) = (16, 8, 16)",
                 "vLLM tried: FLASH_ATTN", "on Hopper (sm90)", "(128, 64, 128)", "mla_prefill_backend",
                 "vLLM's limit on this platform, not p2pweights'"):
        assert said in line, line
    assert "Reasons:" not in line and "\n" not in line  # vLLM's reason cut to its first sentence


def test_the_message_names_vllms_reason_the_head_dims_and_whose_limit_it_is():
    error = ValueError(VLLM_SAYS)
    assert is_mla_prefill_refusal(error) and not is_mla_prefill_refusal(ValueError("something else"))
    config = {"qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
    _assert_reads_as_vllms_refusal(str(mla_prefill_refusal(error, config, VllmLayout.parse(SPEC))))


@pytest.fixture(scope="module")
def deepseek_small_heads(tmp_path_factory) -> str:
    """replica_configs' DeepSeek-V3: MLA head dims (16, 8, 16), which vLLM's FLASH_ATTN does not take."""
    if not (VLLM_SITE / "vllm" / "__init__.py").is_file():
        pytest.skip(f"no vLLM in {VLLM_SITE}: run scripts/setup.sh (it installs vLLM 0.33 there)")
    cfg = CONFIGS["deepseek_v3"]
    assert (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]) == (16, 8, 16)
    return write_config("deepseek_v3", str(tmp_path_factory.mktemp("vllm_refusal_configs")))


def test_check_layout_prints_vllms_refusal_in_one_line_with_exit_2(deepseek_small_heads):
    r = subprocess.run([sys.executable, "-m", "p2pweights", "check-layout", "--engine-kind", "vllm", "--model",
                        deepseek_small_heads, "--engine", SPEC], cwd=ROOT, env=child_env(), capture_output=True,
                       text=True, timeout=240)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = errors(r.stderr)
    assert len(lines) == 1 and r.stdout == "", r.stdout + r.stderr
    assert lines[0].startswith("p2pweights check-layout: error: ")
    _assert_reads_as_vllms_refusal(lines[0])


def test_building_the_replica_raises_the_same_refusal(deepseek_small_heads):
    """The path a sender takes at connect (vllm_env.build_model, under VllmReplicas.get)."""
    code = textwrap.dedent(f"""
        from p2pweights.errors import UnsupportedLayout
        from p2pweights.replica.vllm_site import ensure_vllm
        ensure_vllm("test")
        from p2pweights.replica import vllm_env
        from p2pweights.replica.vllm_layout import VllmLayout
        try:
            vllm_env.build_model({deepseek_small_heads!r}, VllmLayout.parse({SPEC!r}), 0)
        except UnsupportedLayout as e:
            print("REFUSED", e)
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    refused = [line for line in r.stdout.splitlines() if line.startswith("REFUSED ")]
    assert len(refused) == 1, r.stdout + r.stderr
    _assert_reads_as_vllms_refusal(refused[0])
    assert USING in r.stderr
