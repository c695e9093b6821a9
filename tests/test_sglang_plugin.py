"""The p2pweights sglang plugin in a real sglang 0.5.23 server (``python -m sglang.launch_server``,
tp=1, a tiny Qwen3 with dummy weights, on the CPU through the plugin's CPU platform): installed, it
adds ``p2pw_plugin`` to ``/server_info``; ``SGLANG_PLUGINS`` without it leaves it out. And, in this
process against sglang's own functions: the version guard, the refusal, the process kinds."""
from __future__ import annotations

import logging

import pytest

from conftest import require_sglang
from replica_configs import write_config
from sglang_server import start_sglang_server, stop

require_sglang()  # skips without sglang; fails in CI

import p2pweights  # noqa: E402
from p2pweights import sglang_plugin  # noqa: E402
from p2pweights.sglang_plugin import bootstrap_key, gpu_arch, server_info, version_guard  # noqa: E402

ALL_HOOKED = dict(version_guard.HOOKED)  # before a fixture narrows it
KINDS = ("main", "scheduler", "detokenizer", "dp_controller")


@pytest.fixture(scope="module", autouse=True)
def sglang_importable():
    """sglang's scheduler and model-runner modules import torchvision; on this CPU host they get the
    CPU platform's stub, as in the real server's processes (sglang_plugin/cpu_platform.py)."""
    import sys

    from p2pweights.sglang_plugin import cpu_platform

    meta_path = list(sys.meta_path)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SGLANG_PLATFORM", cpu_platform.NAME)
        env.setattr("torch.cuda.is_available", lambda: False)
        cpu_platform.activate()
    yield
    sys.meta_path[:] = meta_path


@pytest.fixture(scope="module")
def server_infos(tmp_path_factory) -> dict[str, dict]:
    """``/server_info`` of two real servers started side by side on one tiny Qwen3: one as installed
    (the plugin loads by itself), one with ``SGLANG_PLUGINS`` naming another plugin only."""
    root = tmp_path_factory.mktemp("sglang_plugin")
    model_dir = write_config("qwen3", str(root))
    envs = {"installed": {}, "excluded": {"SGLANG_PLUGINS": "some_other_plugin"}}
    servers = {name: start_sglang_server(model_dir, str(root / f"{name}.log"), env=env) for name, env in envs.items()}
    try:
        for server in servers.values():
            server.wait_healthy()
        return {name: server.get_json("/server_info") for name, server in servers.items()}
    finally:
        stop(list(servers.values()))


def test_a_real_sglang_server_reports_the_plugin_in_server_info(server_infos):
    info = server_infos["installed"]
    assert info["version"] == version_guard.WRITTEN_FOR  # really sglang's own server
    assert info["device"] == "cpu" and info["load_format"] == "dummy"
    # offers sessions: the HTTP server's hooked function passed the version guard in the real launcher
    assert info["p2pw_plugin"]["version"] == p2pweights.__version__, info.get("p2pw_plugin")
    assert info["p2pw_plugin"]["protocol"] == server_info.PROTOCOL and "error" not in info["p2pw_plugin"]
    assert "sessions" in info["p2pw_plugin"]["offers"] and "gpu_arch" not in info["p2pw_plugin"]  # a CPU server


def test_sglang_plugins_that_does_not_name_p2pweights_leaves_it_out(server_infos):
    info = server_infos["excluded"]
    assert info["version"] == version_guard.WRITTEN_FOR and info["device"] == "cpu"
    assert "p2pw_plugin" not in info


# -- in this process, against sglang 0.5.23's own functions ----------------------------------------
@pytest.fixture
def registered(monkeypatch) -> list[tuple]:
    """The hooks register() hands sglang's HookRegistry (captured, never applied in this process).
    The HTTP server's function is left out of the guard's table here: importing sglang's HTTP server
    costs minutes on a loaded 2-core host (and needs torchvision); the real servers check it."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    monkeypatch.setattr(version_guard, "HOOKED", version_guard.hooked_in("scheduler"))
    calls: list[tuple] = []
    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, target, hook, hook_type, **kw: calls.append(
        (target, hook, hook_type))))
    return calls


def test_the_guard_accepts_the_sglang_it_was_written_for():
    # every process's targets; the HTTP server's (main only) is checked by the real servers above
    assert version_guard.mismatches(kind="scheduler") == {}
    assert version_guard.mismatches(kind="dp_controller") == {}
    assert version_guard.mismatches(version_guard.hooked_in("scheduler", cpu_platform=True)) == {}
    assert {t for kind in KINDS for t in version_guard.hooked_in(kind, cpu_platform=True)} == set(version_guard.HOOKED)
    assert not set(version_guard.hooked_in("scheduler")) & version_guard.HTTP_PROCESS_ONLY
    # a GPU server (no p2pw_cpu platform) neither hooks nor checks the CPU platform's targets
    assert not {t for kind in KINDS for t in version_guard.hooked_in(kind, cpu_platform=False)} & \
        version_guard.CPU_PLATFORM_ONLY


def test_the_guard_names_a_missing_function_and_a_changed_signature():
    problems = version_guard.mismatches({
        "sglang.srt.utils.common.no_such_function": (),
        server_info.TARGET: ("server_args",),
        "sglang.srt.no_such_module.f": (),
    })
    assert set(problems) == {"sglang.srt.utils.common.no_such_function", server_info.TARGET, "sglang.srt.no_such_module.f"}
    assert "missing" in problems["sglang.srt.utils.common.no_such_function"]
    assert "takes (server_args, scheduler_info), written for (server_args)" in problems[server_info.TARGET]


def test_register_adds_the_plugin_to_what_build_server_info_returns(registered):
    from sglang.srt.plugins.hook_registry import HookType

    from p2pweights.sglang_plugin import sessions

    sglang_plugin.register()  # kind main: the launcher, which serves HTTP
    targets = {target for target, _, _ in registered}
    assert targets <= set(ALL_HOOKED) and not targets & {gpu_arch.SCHEDULER_TARGET, bootstrap_key.RANK_TARGET}
    assert (sessions.TARGET, sessions.before_http_server, HookType.BEFORE) in registered
    assert (bootstrap_key.SERVER_TARGET, bootstrap_key.around_server_init, HookType.AROUND) in registered
    assert (bootstrap_key.APP_KWARGS_TARGET, bootstrap_key.after_app_kwargs, HookType.AFTER) in registered
    assert sessions.TARGET in version_guard.HTTP_PROCESS_ONLY  # checked and hooked in the launcher only
    (hook, hook_type), = [(hook, hook_type) for target, hook, hook_type in registered if target == server_info.TARGET]
    assert hook_type is HookType.AFTER
    answer = hook({"version": "0.5.23"}, object(), {})  # no app served in this process: no sessions
    assert answer == {"version": "0.5.23", "p2pw_plugin": {"version": p2pweights.__version__,
                                                           "protocol": server_info.PROTOCOL, "offers": []}}


def test_a_scheduler_process_registers_no_http_hook(registered):
    def run_scheduler_process():  # named as sglang's scheduler entry, which calls load_plugins()
        sglang_plugin.register()

    run_scheduler_process()
    assert sglang_plugin.LOADS[-1]["kind"] == "scheduler"
    targets = [target for target, _, _ in registered]
    assert set(targets) <= set(version_guard.hooked_in("scheduler")) and server_info.TARGET in targets
    assert gpu_arch.SCHEDULER_TARGET in targets and bootstrap_key.RANK_TARGET in targets
    assert not set(targets) & (version_guard.HTTP_PROCESS_ONLY | {bootstrap_key.SERVER_TARGET})


def test_register_refuses_loudly_when_a_hooked_function_is_missing(registered, monkeypatch, caplog):
    missing = "sglang.srt.utils.common.no_such_function"
    monkeypatch.setitem(version_guard.HOOKED, missing, ("server_args",))
    with caplog.at_level(logging.ERROR, logger="p2pweights.sglang_plugin"):
        sglang_plugin.register()
    assert any(missing in r.getMessage() and "refuses to attach" in r.getMessage() for r in caplog.records), caplog.text
    (target, hook, _), = registered  # only the report: no other hook attaches
    assert target == server_info.TARGET
    info = hook({}, object(), {})["p2pw_plugin"]
    assert missing in info["error"] and info["protocol"] == server_info.PROTOCOL
    assert sglang_plugin.LOADS[-1]["error"] == info["error"]


def test_register_without_the_report_function_can_only_log(registered, monkeypatch, caplog):
    monkeypatch.setattr(version_guard, "HOOKED", {server_info.TARGET + "_renamed": ("server_args", "scheduler_info")})
    monkeypatch.setattr(server_info, "TARGET", server_info.TARGET + "_renamed")
    with caplog.at_level(logging.ERROR, logger="p2pweights.sglang_plugin"):
        sglang_plugin.register()
    assert registered == []
    assert "build_server_info_renamed is missing" in caplog.text


def run_scheduler_process():  # named as sglang's scheduler entry, which calls load_plugins()
    return sglang_plugin.process_kind()


def run_detokenizer_process():
    return sglang_plugin.process_kind()


def test_the_process_kind_is_read_from_sglangs_caller():
    assert run_scheduler_process() == "scheduler"
    assert run_detokenizer_process() == "detokenizer"
    assert sglang_plugin.process_kind() == "main"


# -- the CPU platform and sglang's own platform selection ------------------------------------------
@pytest.fixture
def platform_env(monkeypatch):
    """SGLANG_PLATFORM unset, and sys.meta_path restored afterwards (activate() may add the stub)."""
    import sys

    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    return monkeypatch


def test_the_cpu_platform_is_active_only_when_named_and_never_with_cuda(platform_env):
    import torch

    from p2pweights.sglang_plugin import cpu_platform

    assert cpu_platform.activate() is None  # not named: auto-discovery on a CPU host passes it by
    platform_env.setenv("SGLANG_PLATFORM", "p2pw_cpu")
    platform_env.setattr(torch.cuda, "is_available", lambda: False)
    assert cpu_platform.activate() == "p2pweights.sglang_plugin.cpu_platform.CpuHostPlatform"
    platform_env.setattr(torch.cuda, "is_available", lambda: True)
    assert cpu_platform.activate() is None


def test_sglangs_own_selection_is_unchanged_unless_p2pw_cpu_is_named(platform_env):
    """sglang's _resolve_platform with p2pweights installed: its CUDA platform on a CUDA host, its
    own fallback on a CPU host, p2pw_cpu (out of tree, torch-native attention) only when named."""
    import torch
    from sglang.srt import platforms
    from sglang.srt.platforms.cuda import CudaSRTPlatform

    from p2pweights.sglang_plugin.cpu_platform import CpuHostPlatform

    platform_env.setattr(torch.cuda, "is_available", lambda: True)
    platform_env.setattr(torch.version, "hip", None)
    platform_env.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    assert type(platforms._resolve_platform()) is CudaSRTPlatform
    platform_env.setattr(torch.cuda, "is_available", lambda: False)
    assert not isinstance(platforms._resolve_platform(), CpuHostPlatform)
    platform_env.setenv("SGLANG_PLATFORM", "p2pw_cpu")
    chosen = platforms._resolve_platform()
    assert type(chosen) is CpuHostPlatform and chosen.is_out_of_tree() and chosen.device_type == "cpu"
    assert chosen.get_default_attention_backend() == "torch_native"
