"""The vLLM tests (replica and backend, ``conftest.VLLM_TESTS``) in a child pytest whose path holds
vLLM 0.33 as scripts/setup.sh installs it (``.vllm_site``, apart from sglang's packages). When this
process imports vLLM itself, conftest collects those files here instead and this test has nothing to do.
A missing install fails: the vLLM engines' guarantees are proven by those files, never skipped."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, VLLM_SITE, VLLM_TESTS, _vllm_importable


def test_the_vllm_replica_and_backend_tests_pass_with_vllm_installed_apart():
    if _vllm_importable():
        pytest.skip("this process imports vLLM: the vLLM test files are collected here directly")
    assert (VLLM_SITE / "vllm" / "__init__.py").is_file(), (
        f"no vLLM in {VLLM_SITE}: run scripts/setup.sh (it installs vllm 0.33.0 there, apart from sglang's packages)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(VLLM_SITE), os.environ.get("PYTHONPATH"))))}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                          *(str(ROOT / "tests" / name) for name in VLLM_TESTS)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, f"the vLLM tests failed (exit {run.returncode}):\n{tail}"
    summary = re.search(r"(\d+) passed", run.stdout)
    assert summary and int(summary.group(1)) > 0, f"the vLLM tests ran nothing:\n{tail}"
    assert " skipped" not in run.stdout.splitlines()[-1], f"a vLLM test was skipped:\n{tail}"
