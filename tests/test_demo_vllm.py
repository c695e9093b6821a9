"""`p2pweights demo --engine-kind vllm` (commands/demo_vllm.py, docs/vllm.md "The demo against
stand-in vLLM engines"): the demo's own command function, run against one stand-in vLLM 0.33 engine
(vLLM's CPU worker in a process of its own, vLLM's routes and the gate over uvicorn) with the demo's
sender processes writing over real Mooncake; every step judged by vLLM's ``/weight_checker`` checksums
against a fresh vLLM load of the same checkpoint in a reference process. Runs in the vLLM child pytest
(conftest.VLLM_TESTS)."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's CpuPlatform (the CUDA one cannot import here)
os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")  # vLLM mounts its RL routes only then

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not importable: tests/test_vllm_suite.py runs this file with vLLM on the path",
                allow_module_level=True)

from p2pweights.commands import demo, demo_vllm  # noqa: E402
from p2pweights.errors import UnsupportedLayout, WrongTransport  # noqa: E402
from replica_configs import write_config  # noqa: E402


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(["--engine-kind", "vllm", *argv])


def _demo_steps(capsys, *argv: str) -> list[dict]:
    """The demo's rows of a 2-step run with 1% changed over Mooncake (``--json``); it must exit 0."""
    rc = demo.run(_args(*argv, "--steps", "2", "--changed-fraction", "0.01", "--transport", "mooncake", "--json"))
    out = capsys.readouterr()
    assert rc == 0, out.err[-3000:]
    # the document the demo prints (a vLLM imported earlier in this pytest process may log to stdout)
    return json.loads(out.out[out.out.index('{\n  "steps"'):])["steps"]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return write_config("qwen3", str(tmp_path_factory.mktemp("demo_vllm_cfg")))


def test_the_vllm_demo_updates_a_dp2_stand_in_engine_equal_to_a_fresh_vllm_load_then_sends_deltas(cfg, capsys):
    # dp=2: two DP ranks of tp=1 (dense: each an independent engine in vLLM), each checked against the load
    steps = _demo_steps(capsys, "--model", cfg, "--engine", "dp=2", "--engines", "1", "--senders", "2")
    assert [(s["mode"], s["transport"], s["step"]) for s in steps] == [("p2p", "mooncake", 1), ("p2p", "mooncake", 2)]
    assert all(s["equal"] is True for s in steps), [s["detail"] for s in steps]
    first, second = steps
    assert first["bytes"] > 0 and first["bytes_written"] == first["bytes"]  # no base yet: a full write
    # the second step goes as delta records: about 1% of the elements changed
    assert second["bytes"] == first["bytes"] and 0 < second["bytes_written"] < second["bytes"] // 4, second
    assert not second["delta_reason"], second


def test_the_vllm_demo_updates_a_tp2_engine_rank_by_rank_equal_to_a_fresh_tp2_vllm_load(cfg, capsys):
    steps = _demo_steps(capsys, "--model", cfg, "--engine", "tp=2", "--engines", "1", "--senders", "1")
    assert all(s["equal"] is True for s in steps), [s["detail"] for s in steps]
    first, second = steps
    assert first["bytes_written"] == first["bytes"] and 0 < second["bytes_written"] < second["bytes"] // 4, second


def test_what_the_stand_in_vllm_engines_cannot_do_is_refused_before_anything_starts(cfg, monkeypatch, tmp_path):
    with pytest.raises(WrongTransport, match="Mooncake only"):
        demo.run(_args("--model", cfg, "--transport", "nixl"))
    with pytest.raises(UnsupportedLayout, match="NCCL on GPUs"):
        demo.run(_args("--model", cfg, "--modes", "p2p,broadcast", "--transport", "mooncake"))
    with pytest.raises(UnsupportedLayout, match="tensor and data parallelism only"):
        demo.run(_args("--model", cfg, "--engine", "tp=1,ep=2", "--transport", "mooncake"))
    with pytest.raises(UnsupportedLayout, match="tensor and data parallelism only"):
        demo.run(_args("--model", cfg, "--engine", "tp=2,pp=2", "--transport", "mooncake"))
    with pytest.raises(UnsupportedLayout, match="BF16 models only"):
        demo.run(_args("--model", "deepseek-v3-fp8-tiny", "--transport", "mooncake"))
    with pytest.raises(UnsupportedLayout, match="NCCL on GPUs"):  # the function refuses too, not only the command
        demo_vllm.run_vllm_demo(cfg, modes=("broadcast",), progress=lambda line: None)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    monkeypatch.setenv("P2PW_VLLM_SITE", str(tmp_path))  # vLLM neither importable nor in the folder named
    with pytest.raises(UnsupportedLayout, match="scripts/setup.sh"):
        demo.run(_args("--model", cfg, "--transport", "mooncake"))
