"""Helpers every test file may use (``from conftest import shared_model, require_sglang``): where
the model configs are, without assuming one machine's paths, and sglang required where it must be."""
from __future__ import annotations

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# the shared models folder sits beside the project root on the development machines
SHARED_MODELS = ROOT.parent / "shared" / "models"
# the package's built-in configs (same files for the models both hold)
BUILTIN_MODELS = ROOT / "python" / "p2pweights" / "models"
# the benchmarks' model configs (the large models of the cost tables)
BENCH_MODELS = ROOT / "benchmarks" / "models"


def shared_model(name: str) -> str:
    """The folder holding model ``name``'s config.json: ``<root>/../shared/models/NAME``, else the
    built-in ``python/p2pweights/models/NAME``; skips the test, saying where it looked, when neither
    has it (never a silent pass)."""
    for folder in (SHARED_MODELS / name, BUILTIN_MODELS / name):
        if (folder / "config.json").is_file():
            return str(folder)
    pytest.skip(f"model {name!r}: no config.json in {SHARED_MODELS} nor {BUILTIN_MODELS}")


def in_ci() -> bool:
    """True in CI (``CI`` set to a true value, as GitHub Actions and most CI systems do)."""
    from p2pweights.settings import parse_bool

    try:
        return parse_bool(os.environ.get("CI", ""))
    except ValueError:
        return True  # CI set to something else still means CI


def require_sglang():
    """``import sglang``, else skip; in CI (``CI=true``) a missing sglang fails instead, since a skip
    there would drop the byte-exactness tests unnoticed. Usable at module level and in a test."""
    try:
        import sglang
    except ImportError as e:
        if in_ci():
            pytest.fail(f"CI=true but sglang cannot be imported ({e}): the byte-exactness tests need it "
                        f"(bash scripts/setup.sh installs it)", pytrace=False)
        pytest.skip(f"sglang is not importable ({e})", allow_module_level=True)
    return sglang



# -- vLLM: installed apart (scripts/setup.sh, .vllm_site), on the path of its tests' own process only ---------
VLLM_SITE = ROOT / ".vllm_site"
VLLM_TESTS = ("test_vllm_replica.py", "test_vllm_backend.py", "test_vllm_sender.py", "test_vllm_tp.py",
              "test_demo_vllm.py", "test_vllm_draft_replica.py", "test_vllm_draft.py",
              "test_vllm_dp.py", "test_vllm_lora.py", "test_vllm_check_layout_lora.py", "test_vllm_replay.py",
              "test_vllm_adapter_update.py", "test_vllm_default_kernels_updates.py", "test_vllm_group_writers.py")


def _vllm_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


# Where this process has no vLLM, its tests run in tests/test_vllm_suite.py's child pytest (PYTHONPATH
# .vllm_site), not here: putting .vllm_site on this process's path would hand every sglang test vLLM's
# openai and make sglang's CPU kernels take vLLM's GPU-only ops.
collect_ignore = [] if _vllm_importable() else list(VLLM_TESTS)
