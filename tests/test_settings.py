"""The settings registry: every P2PW_ variable declared once, read in one place, overridable by
keyword, and checked by `p2pweights doctor`."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

from p2pweights import settings as S

ROOT = pathlib.Path(__file__).resolve().parents[1]
PKG = ROOT / "python" / "p2pweights"


def test_no_module_reads_a_p2pw_variable_outside_the_registry():
    offenders = []
    for path in PKG.rglob("*.py"):
        if path.name == "settings.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("P2PW_"):
                parent_calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and node in ast.walk(n)]
                reads_env = any("environ" in ast.unparse(c.func) or "getenv" in ast.unparse(c.func)
                                for c in parent_calls)
                if reads_env:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
    assert not offenders, "read these through p2pweights.settings.value(): " + ", ".join(offenders)


def test_every_p2pw_name_used_in_the_package_is_declared():
    used = set()
    for path in list(PKG.rglob("*.py")) + list((ROOT / "csrc").rglob("*.[ch]pp")):
        used |= set(re.findall(r"\bP2PW_[A-Z][A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    used -= {"P2PW_VERSION", "P2PW_BUILD_BENCHMARKS", "P2PW_BUILD_PYTHON",  # CMake/compile-time, not settings
             "P2PW_COPY_KERNEL", "P2PW_HAVE_COPY_KERNEL", "P2PW_HAVE_DELTA_KERNEL", "P2PW_HAVE_DELTA_APPLY_KERNEL",
             "P2PW_NVCC"}
    assert used <= set(S.REGISTRY), f"undeclared: {sorted(used - set(S.REGISTRY))}"


def test_keyword_wins_over_environment_which_wins_over_default(monkeypatch):
    monkeypatch.delenv("P2PW_NUM_SLOTS", raising=False)
    assert S.lookup("P2PW_NUM_SLOTS") == (None, "default")  # unset: sender/buffers.slot_count decides by device
    monkeypatch.setenv("P2PW_NUM_SLOTS", "3")
    assert S.lookup("P2PW_NUM_SLOTS") == (3, "P2PW_NUM_SLOTS")
    assert S.lookup("num_slots", 4) == (4, "keyword")
    assert S.settings(num_slots=5).num_slots == 5
    assert S.settings().num_slots == 3


def test_an_honoured_vendor_variable_is_read_when_ours_is_unset(monkeypatch):
    monkeypatch.delenv("P2PW_NIXL_BACKEND", raising=False)
    monkeypatch.setenv("SGLANG_REMOTE_INSTANCE_NIXL_BACKEND", "GDS")
    assert S.lookup("P2PW_NIXL_BACKEND") == ("GDS", "SGLANG_REMOTE_INSTANCE_NIXL_BACKEND")
    monkeypatch.setenv("P2PW_NIXL_BACKEND", "UCX")
    assert S.value("P2PW_NIXL_BACKEND") == "UCX"


@pytest.mark.parametrize("name,raw", [("P2PW_NUM_SLOTS", "0"), ("P2PW_TRANSPORT", "tcp"),
                                      ("P2PW_BUFFER_SIZE", "lots"), ("P2PW_RECEIVER_GPUS", "a,b"),
                                      ("P2PW_ENGINE_TIMEOUT", "-1")])
def test_an_invalid_value_names_the_variable(monkeypatch, name, raw):
    monkeypatch.setenv(name, raw)
    with pytest.raises(S.SettingError, match=name):
        S.value(name)


def test_unknown_keyword_is_refused_with_the_known_ones():
    with pytest.raises(TypeError, match="buffer_size"):
        S.settings(bufer_size=1)


def test_transport_options_follow_the_transport(monkeypatch):
    for k in ("P2PW_MOONCAKE_PROTOCOL", "MOONCAKE_PROTOCOL", "P2PW_HOSTNAME", "P2PW_MOONCAKE_DEVICE", "MOONCAKE_DEVICE"):
        monkeypatch.delenv(k, raising=False)
    assert S.settings(transport="nixl", nixl_backend="UCX", nixl_progress_delay_us=0).transport_options() == \
        {"backend": "UCX", "progress_delay": 0}
    assert S.settings(transport="mooncake", mooncake_protocol="tcp").transport_options() == {"protocol": "tcp"}


def _doctor(env: dict) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("P2PW_")}
    full.update(env)
    return subprocess.run([sys.executable, "-m", "p2pweights", "doctor"], env=full, capture_output=True,
                          text=True, timeout=120)


def test_doctor_shows_every_setting_with_its_source():
    r = _doctor({"P2PW_NUM_SLOTS": "3"})
    assert r.returncode == 0, r.stderr
    for name in S.REGISTRY:
        assert name in r.stdout
    assert re.search(r"P2PW_NUM_SLOTS\s+3\s+\[P2PW_NUM_SLOTS\]", r.stdout)
    assert re.search(r"P2PW_TRANSPORT\s+auto\s+\[default\]", r.stdout)


@pytest.mark.parametrize("env", [{"P2PW_NUM_SLOTS": "zero"}, {"P2PW_TRANSPROT": "nixl"}])
def test_doctor_exits_non_zero_on_an_invalid_or_unknown_setting(env):
    r = _doctor(env)
    assert r.returncode != 0
    assert next(iter(env)) in r.stdout and "INVALID" in r.stdout


# -- scopes: the sender's settings are exactly WeightSender's keywords ------------------------------
SENDER = [s for s in S.REGISTRY.values() if s.scope == "sender"]
CONFIG = str(PKG / "models" / "qwen3-0.6b")  # a built-in config: constructing a sender reads only it


def test_every_setting_declares_who_reads_it():
    assert {s.scope for s in S.REGISTRY.values()} <= set(S.SCOPES)
    assert [f.name for f in dataclasses.fields(S.Settings)] == [s.key for s in SENDER]


@pytest.mark.parametrize("setting", SENDER, ids=lambda s: s.key)
def test_every_sender_setting_is_a_weight_sender_keyword(setting, tmp_path):
    from p2pweights.sender.weight_sender import WeightSender

    given = setting.default if setting.default is not None else str(tmp_path)  # None: any valid text
    if setting.key == "num_slots":
        given = 3  # unset by default (sender/buffers.slot_count): a count
    if setting.key == "prepare":
        given = False  # True would import sglang on a thread: the keyword path is the same
    sender = WeightSender(CONFIG, **{setting.key: given})
    try:
        assert getattr(sender.settings, setting.key) == setting.coerce(given, setting.key)
        assert S.lookup(setting.env, given)[1] == "keyword"
    finally:
        sender.close()
    assert setting.key in inspect.signature(WeightSender).parameters  # help() and editors show it


def test_nixl_api_python_keyword_reaches_the_transport(monkeypatch):
    """The README's example: WeightSender(cfg, nixl_api="python") picks NIXL's Python data path."""
    from p2pweights.sender.weight_sender import WeightSender
    from p2pweights.transport import nixl_native

    made = []
    monkeypatch.setattr(nixl_native, "make_nixl_transport", lambda api=None, **opts: made.append(api) or "t")
    sender = WeightSender(CONFIG, transport="nixl", nixl_api="python")
    try:
        assert sender._make_transport() == "t" and made == ["python"]
    finally:
        sender.close()


def test_copy_threads_and_lanes_keywords_reach_the_replay_order():
    from p2pweights.sender.weight_sender import WeightSender

    sender = WeightSender(CONFIG, copy_threads=3, copy_lanes=1)
    try:
        assert (sender.replay_order.threads, sender.replay_order.lanes) == (3, 1)
    finally:
        sender.close()


@pytest.mark.parametrize("kw,match", [({"num_slots": 2.5}, r"num_slots=2\.5: must be an integer"),
                                      ({"num_slots": "two"}, "num_slots='two'"),
                                      ({"buffer_size": True}, "buffer_size=True: must be a size"),
                                      ({"nixl_api": 1}, "nixl_api=1: must be a string"),
                                      ({"check_finite": "maybe"}, "check_finite='maybe': must be a boolean")])
def test_a_wrong_typed_keyword_fails_naming_the_setting(kw, match):
    from p2pweights.sender.weight_sender import WeightSender

    with pytest.raises(S.SettingError, match=match):
        WeightSender(CONFIG, **kw)


def test_a_receiver_setting_given_to_the_sender_says_whose_it_is():
    from p2pweights.sender.weight_sender import WeightSender

    with pytest.raises(TypeError, match=r"log_level \(P2PW_LOG_LEVEL\) is an engine setting"):
        WeightSender(CONFIG, log_level="INFO")


# -- one boolean parser ----------------------------------------------------------------------------
@pytest.mark.parametrize("raw,parsed", [("1", True), ("true", True), ("Yes", True), (" on ", True), (True, True),
                                        (1, True), ("", False), ("0", False), ("FALSE", False), ("no", False),
                                        ("off", False), (False, False), (0, False)])
def test_one_boolean_parser_reads_every_usual_spelling(raw, parsed):
    assert S.parse_bool(raw) is parsed


@pytest.mark.parametrize("raw", ["2", "enabled", 2, None, 1.0])
def test_the_boolean_parser_refuses_what_is_not_a_boolean(raw):
    with pytest.raises(ValueError, match="must be a boolean"):
        S.parse_bool(raw)


def test_every_on_off_setting_is_read_by_the_one_boolean_parser(monkeypatch):
    switches = [s for s in S.REGISTRY.values() if s.doc.startswith("`1`:")]
    assert len(switches) >= 6
    for s in switches:
        assert s.parse is S.parse_bool, s.env
        monkeypatch.setenv(s.env, "true")
        assert S.value(s.env) is True


@pytest.mark.parametrize("env", [{"P2PW_GPU_SITE": "/tmp/p2pw-gpu-test"}, {"P2PW_NO_SGL_KERNEL_STUB": "1"}])
def test_doctor_accepts_the_variables_the_gpu_scripts_document(env):
    r = _doctor(env)
    assert r.returncode == 0, r.stdout + r.stderr
    name = next(iter(env))
    assert re.search(rf"{name}\s+\S+\s+\[{name}\]", r.stdout)


def test_the_sgl_kernel_stub_reads_its_switch_as_the_boolean_parser_does():
    """The GPU bundle's stub (scripts/gpu_bundle.sh) cannot import p2pweights: its spellings are pinned here."""
    script = (ROOT / "scripts" / "gpu_bundle.sh").read_text()
    m = re.search(r'environ\.get\("P2PW_NO_SGL_KERNEL_STUB", ""\)\.strip\(\)\.lower\(\) in (\([^)]*\))', script)
    assert m, "the sgl_kernel stub no longer reads P2PW_NO_SGL_KERNEL_STUB as expected"
    assert ast.literal_eval(m.group(1)) == S._TRUE
