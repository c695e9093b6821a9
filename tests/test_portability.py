"""The test helpers of conftest.py: no machine's absolute paths, and no silent skip of sglang in CI."""
from __future__ import annotations

import sys

import pytest

import conftest


def test_a_model_falls_back_to_the_built_in_config_without_the_shared_folder(monkeypatch, tmp_path):
    monkeypatch.setattr(conftest, "SHARED_MODELS", tmp_path / "absent")
    assert conftest.shared_model("qwen3-4b") == str(conftest.BUILTIN_MODELS / "qwen3-4b")


def test_the_shared_folder_beside_the_root_comes_first(monkeypatch, tmp_path):
    (tmp_path / "qwen3-4b").mkdir()
    (tmp_path / "qwen3-4b" / "config.json").write_text("{}")
    monkeypatch.setattr(conftest, "SHARED_MODELS", tmp_path)
    assert conftest.shared_model("qwen3-4b") == str(tmp_path / "qwen3-4b")


def test_a_model_found_nowhere_skips_saying_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.setattr(conftest, "SHARED_MODELS", tmp_path)
    with pytest.raises(pytest.skip.Exception, match="no-such-model.*no config.json in"):
        conftest.shared_model("no-such-model")


@pytest.mark.parametrize("ci,outcome", [("true", pytest.fail.Exception), ("1", pytest.fail.Exception),
                                        ("", pytest.skip.Exception), ("false", pytest.skip.Exception)])
def test_a_missing_sglang_fails_in_ci_and_skips_elsewhere(monkeypatch, ci, outcome):
    monkeypatch.setitem(sys.modules, "sglang", None)  # import sglang -> ImportError
    monkeypatch.setenv("CI", ci)
    with pytest.raises(outcome, match="sglang"):
        conftest.require_sglang()
