"""What the sglang plugin's protocol 3 adds: the GPU architecture in ``/server_info``
(``p2pw_plugin.gpu_arch``, sglang_plugin/gpu_arch.py), which the sender takes when it was given none,
and the server's API key on the engine-info bootstrap server (sglang_plugin/bootstrap_key.py).

In this process, against sglang 0.5.23's own functions: the hooks on the scheduler's ready message,
on ``build_server_info``, and on sglang's own ``EngineInfoBootstrapServer`` (started for real, on a
local port), on a rank's real ``_register_to_engine_info_bootstrap`` and on ``requests``, each
wrapped by sglang's own hook wrapper. Then one real server (``python -m sglang.launch_server``,
tp=1, a tiny Qwen3 on the CPU platform) started with ``--api-key``: it starts, its rank publishes,
and its bootstrap server and proxy route take the key and refuse calls without it."""
from __future__ import annotations

import asyncio
import sys
import time
import types

import pytest

from conftest import require_sglang
from replica_configs import _COMMON, CONFIGS, write_config
from sglang_server import free_port, start_sglang_server

require_sglang()  # skips without sglang; fails in CI

import p2pweights  # noqa: E402
from p2pweights.control import http  # noqa: E402
from p2pweights.control import protocol as p  # noqa: E402
from p2pweights.control.sglang import SglangEngine  # noqa: E402
from p2pweights.errors import EngineMismatch, EngineUnreachable, Unauthorized  # noqa: E402
from p2pweights.replica.build_check import PLUGIN_ARCH, engine_identity, replica_environment  # noqa: E402
from p2pweights.sglang_plugin import bootstrap_key, bootstrap_requests, gpu_arch, server_info, version_guard  # noqa: E402

KEY = "k-" + "0123456789abcdef"
FP8 = {**_COMMON, **CONFIGS["deepseek_v3"],
       "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}}
#: the keys connect reads of an FP8 engine's /server_info (sglang 0.5.23's own)
FP8_ENGINE = {"version": replica_environment().sglang_version, "device": "cuda", "moe_runner_backend": "auto",
              "moe_a2a_backend": "none", "fp8_gemm_runner_backend": "auto",
              "disable_shared_experts_fusion": False, "enforce_shared_experts_fusion": False}


def plugin(protocol: int = p.PLUGIN_PROTOCOL, **fields) -> dict:
    return {p.PLUGIN_FIELD: {"version": "0.1.0", "protocol": protocol, "offers": [], **fields}}


@pytest.fixture(scope="module", autouse=True)
def sglang_importable():
    """sglang's scheduler and model-runner modules import torchvision; on this CPU host they get the
    CPU platform's stub, as in the real server's processes (sglang_plugin/cpu_platform.py)."""
    from p2pweights.sglang_plugin import cpu_platform

    meta_path = list(sys.meta_path)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SGLANG_PLATFORM", cpu_platform.NAME)
        env.setattr("torch.cuda.is_available", lambda: False)
        cpu_platform.activate()
    yield
    sys.meta_path[:] = meta_path


# -- the GPU architecture -------------------------------------------------------------------------
def test_every_target_hooked_here_is_checked_by_the_version_guard_in_its_process_kind():
    for target, kind in [(gpu_arch.SCHEDULER_TARGET, "scheduler"), (gpu_arch.DP_CONTROLLER_TARGET, "dp_controller"),
                         (bootstrap_key.SERVER_TARGET, "main"), (bootstrap_key.APP_KWARGS_TARGET, "main"),
                         (bootstrap_key.HTTP_SERVER_TARGET, "main"), (bootstrap_key.RANK_TARGET, "scheduler"),
                         (bootstrap_key.REQUESTS_TARGET, "main"), (bootstrap_key.REQUESTS_TARGET, "scheduler")]:
        assert target in version_guard.hooked_in(kind), (target, kind)
    assert gpu_arch.SCHEDULER_TARGET not in version_guard.hooked_in("main")
    assert bootstrap_key.SERVER_TARGET not in version_guard.hooked_in("scheduler")
    targets = {t: version_guard.HOOKED[t] for t in (gpu_arch.DP_CONTROLLER_TARGET, bootstrap_key.SERVER_TARGET,
                                                     bootstrap_key.APP_KWARGS_TARGET, bootstrap_key.RANK_TARGET,
                                                     bootstrap_key.REQUESTS_TARGET)}
    assert version_guard.mismatches(targets) == {}  # sglang 0.5.23's own (the scheduler's: test_sglang_plugin.py)


@pytest.fixture
def on_gpu(monkeypatch):
    """This process as a rank on GPU 3 of compute capability 9.0 (torch and sglang's runtime context)."""
    import sglang.srt.runtime_context as runtime_context
    import torch

    asked = []
    monkeypatch.setattr(runtime_context, "get_device", lambda: types.SimpleNamespace(gpu_id=3, device="cuda"))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: asked.append(index) or (9, 0))
    return asked


def test_a_gpu_rank_reports_its_architecture_in_the_receivers_spelling(on_gpu):
    ready = gpu_arch.after_scheduler_init_info({"status": "ready"}, types.SimpleNamespace(device="cuda"))
    assert ready == {"status": "ready", gpu_arch.KEY: "sm90"}
    assert on_gpu == [3]  # the rank's own device (get_device().gpu_id), not device 0


def test_a_rank_off_cuda_reports_no_architecture(on_gpu):
    assert gpu_arch.after_scheduler_init_info({"status": "ready"}, types.SimpleNamespace(device="cpu")) == {
        "status": "ready"}
    assert on_gpu == []


def test_a_dp_controller_passes_its_schedulers_architecture_on():
    controller = types.SimpleNamespace(_scheduler_init_infos=[{"status": "ready"}, {gpu_arch.KEY: "sm90"}])
    assert gpu_arch.after_dp_controller_init_info({"max_total_num_tokens": 8}, controller) == {
        "max_total_num_tokens": 8, gpu_arch.KEY: "sm90"}


def test_server_info_carries_the_architecture_inside_p2pw_plugin_only():
    hook = server_info.after_build("0.1.0", None, server_info.combined(bootstrap_key.live))
    # what build_server_info returns: the server args, with the first scheduler's ready message merged in
    answer = hook({"device": "cuda", "max_total_num_tokens": 8, gpu_arch.KEY: "sm90"}, object(), {})
    assert gpu_arch.KEY not in answer
    assert answer[p.PLUGIN_FIELD] == {"version": "0.1.0", "protocol": 3, "offers": [], "gpu_arch": "sm90"}
    assert p.plugin_gpu_arch(answer) == "sm90"
    on_cpu = hook({"device": "cpu"}, object(), {})
    assert "gpu_arch" not in on_cpu[p.PLUGIN_FIELD] and p.plugin_gpu_arch(on_cpu) is None


def test_only_a_plugin_of_protocol_3_on_is_read_for_the_architecture():
    assert p.plugin_gpu_arch(plugin(gpu_arch="sm90")) == "sm90"
    assert p.plugin_gpu_arch(plugin(protocol=2, gpu_arch="sm90")) is None
    assert p.plugin_gpu_arch({"gpu_arch": "sm90"}) is None and p.plugin_gpu_arch(None) is None


def test_the_sender_takes_the_plugins_architecture_when_given_none():
    identity = engine_identity("e0", {**FP8_ENGINE, **plugin(gpu_arch="sm90")}, FP8)
    assert (identity.arch, identity.arch_source) == ("sm90", PLUGIN_ARCH)
    assert engine_identity("e0", {**FP8_ENGINE, **plugin(gpu_arch="sm90")}, FP8, gpu_arch="9.0").arch == "sm90"
    blackwell = engine_identity("e0", {**FP8_ENGINE, **plugin(gpu_arch="sm100")}, FP8)  # replayed on send
    assert (blackwell.arch, blackwell.layout_arch()) == ("sm100", "sm100")
    with pytest.raises(EngineMismatch, match=r"runs on sm120 \(/server_info p2pw_plugin.gpu_arch\)"):
        engine_identity("e0", {**FP8_ENGINE, **plugin(gpu_arch="sm120")}, FP8)  # SM12x: refused for FP8
    with pytest.raises(EngineMismatch, match="does not report its GPU architecture"):
        engine_identity("e0", {**FP8_ENGINE, **plugin(protocol=2, gpu_arch="sm90")}, FP8)


def test_an_explicit_gpu_arch_that_contradicts_the_plugin_is_refused_naming_both():
    with pytest.raises(EngineMismatch) as refused:
        engine_identity("rollout-3", {**FP8_ENGINE, **plugin(gpu_arch="sm90")}, FP8, gpu_arch="sm100")
    said = str(refused.value)
    assert "rollout-3" in said and "gpu_arch=sm100" in said and "reports sm90" in said, said
    assert refused.value.parameter == "gpu_arch"
    with pytest.raises(EngineMismatch, match="not a GPU architecture"):
        engine_identity("e0", {**FP8_ENGINE, **plugin(gpu_arch="hopper")}, FP8)


# -- the key on sglang's own bootstrap server, in this process --------------------------------------
def _wrapped(monkeypatch, owner, attr: str, hook, hook_type) -> None:
    """``owner.attr`` as sglang's HookRegistry leaves it with ``hook`` applied (its own wrapper)."""
    from sglang.srt.plugins.hook_registry import _wrap_fn

    monkeypatch.setattr(owner, attr, _wrap_fn(getattr(owner, attr), hook, hook_type))


def _serving(monkeypatch, api_key=None, admin_api_key=None, workers=1) -> None:
    import sglang.srt.runtime_context as runtime_context

    monkeypatch.setattr(runtime_context, "get_serving", lambda: types.SimpleNamespace(
        api_key=api_key, admin_api_key=admin_api_key, tokenizer_worker_num=workers))


@pytest.fixture
def hooked(monkeypatch):
    """sglang's bootstrap server class, a rank's registration and requests, with the plugin's hooks."""
    import requests
    from sglang.srt.entrypoints import engine_info_bootstrap_server as bootstrap_module
    from sglang.srt.model_executor.model_runner_components import remote_instance_weight_transporter as transporter
    from sglang.srt.plugins.hook_registry import HookType

    monkeypatch.setattr(bootstrap_key, "GUARDED", None)
    monkeypatch.setattr(bootstrap_key, "REFUSED", None)
    server_class = bootstrap_module.EngineInfoBootstrapServer
    _wrapped(monkeypatch, server_class, "__init__", bootstrap_key.around_server_init, HookType.AROUND)
    _wrapped(monkeypatch, bootstrap_module, "fastapi_telemetry_disabled_kwargs", bootstrap_key.after_app_kwargs,
             HookType.AFTER)
    _wrapped(monkeypatch, requests.sessions.Session, "request", bootstrap_requests.around_session_request, HookType.AROUND)
    rank_registration = transporter.RemoteInstanceWeightTransporter._register_to_engine_info_bootstrap
    servers = []

    def start(**keys):
        _serving(monkeypatch, **keys)
        port = free_port()
        servers.append(server_class("127.0.0.1", port))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if http.request("GET", url, "/health", timeout=5)[0] == p.OK:
                    return url
            except EngineUnreachable:
                pass
            assert time.monotonic() < deadline, "the bootstrap server did not start"
            time.sleep(0.05)

    def publish(url: str, tp_rank: int, hooked_rank: bool = True) -> None:
        """sglang's own PUT of a rank's table (its real function), the plugin's hook around it or not."""
        port = int(url.rsplit(":", 1)[1])
        monkeypatch.setattr(transporter, "get_parallel", lambda: types.SimpleNamespace(dist_init_addr=None))
        monkeypatch.setattr(transporter, "get_model", lambda: types.SimpleNamespace(engine_info_bootstrap_port=port))
        rank = types.SimpleNamespace(tp_rank=tp_rank, session_id="192.0.2.7:15000", weight_info={"w": [4096, 8, 2]})
        if hooked_rank:
            bootstrap_key.around_rank_registration(rank_registration, rank)
        else:
            rank_registration(rank)

    yield types.SimpleNamespace(start=start, publish=publish)
    for server in servers:
        server.close()


def _get(url: str, rank: int, key: str | None = None) -> tuple[int, object]:
    return http.request("GET", url, "/get_transfer_engine_info", params={"rank": rank}, api_key=key, timeout=10)


def _put(url: str, rank: int, key: str | None = None) -> int:
    body = {"tp_rank": rank, "transfer_engine_info": {"session_id": "203.0.113.9:1", "weights_info_dict": {}}}
    return http.request("PUT", url, "/register_transfer_engine_info", body=body, api_key=key, timeout=10)[0]


def test_with_a_key_the_bootstrap_server_refuses_every_call_without_it(hooked):
    url = hooked.start(api_key=KEY)
    assert bootstrap_key.live() == {"offers": [p.PLUGIN_BOOTSTRAP_KEY], "error": None}
    assert _put(url, 0) == p.UNAUTHORIZED and _put(url, 0, "wrong") == p.UNAUTHORIZED
    assert _get(url, 0) == (p.UNAUTHORIZED, {"error": "Unauthorized"})  # sglang's own answer
    assert _put(url, 0, KEY) == p.OK
    assert _get(url, 0, KEY) == (p.OK, {"rank": 0, "remote_instance_transfer_engine_info": ["203.0.113.9:1", {}]})
    assert http.request("GET", url, "/health", timeout=5)[0] == p.OK  # probes stay open, as on sglang's server


def test_the_admin_key_is_the_one_when_both_are_set(hooked):
    url = hooked.start(api_key=KEY, admin_api_key="admin-" + KEY)
    assert _put(url, 0, KEY) == p.UNAUTHORIZED  # sglang's ADMIN_OPTIONAL rule
    assert _put(url, 0, "admin-" + KEY) == p.OK


def test_a_ranks_own_registration_carries_the_key(hooked):
    url = hooked.start(api_key=KEY)
    hooked.publish(url, 0, hooked_rank=False)  # sglang's PUT as it is: refused
    assert _get(url, 0, KEY)[0] == p.NOT_FOUND
    hooked.publish(url, 0)
    assert _get(url, 0, KEY) == (p.OK, {"rank": 0, "remote_instance_transfer_engine_info": [
        "192.0.2.7:15000", {"w": [4096, 8, 2]}]})


def test_the_proxy_route_carries_the_key_and_no_other_call_does(hooked):
    import requests

    url = hooked.start(api_key=KEY)
    assert _put(url, 0, KEY) == p.OK
    statuses = []

    async def sglang_route(scope, receive, send):  # what the proxy route does: a blocking GET, no header
        statuses.append(requests.get(f"{url}/get_transfer_engine_info", params={"rank": 0}, timeout=5).status_code)

    proxy = bootstrap_key.ProxyCarriesKey(sglang_route, key=KEY)
    for path in ("/remote_instance_transfer_engine_info", "/get_remote_instance_transfer_engine_info", "/generate"):
        asyncio.run(proxy({"type": "http", "path": path}, None, None))
    assert statuses == [p.OK, p.OK, p.UNAUTHORIZED]
    assert requests.get(f"{url}/get_transfer_engine_info", params={"rank": 0}, timeout=5).status_code == p.UNAUTHORIZED


def test_without_a_key_the_bootstrap_server_stays_sglangs_own(hooked):
    url = hooked.start()
    assert bootstrap_key.live() == {"offers": [], "error": None}
    assert _put(url, 0) == p.OK and _get(url, 0)[0] == p.OK
    import fastapi  # sglang's other apps: the keyword arguments pass untouched outside the construction
    from sglang.srt.entrypoints import engine_info_bootstrap_server as bootstrap_module

    assert "middleware" not in bootstrap_module.fastapi_telemetry_disabled_kwargs()
    assert isinstance(fastapi.FastAPI(**bootstrap_module.fastapi_telemetry_disabled_kwargs()), fastapi.FastAPI)


def test_several_http_workers_leave_reads_open_and_guard_writes(hooked):
    url = hooked.start(api_key=KEY, workers=2)
    assert _put(url, 0) == p.UNAUTHORIZED and _put(url, 0, KEY) == p.OK
    assert _get(url, 0)[0] == p.OK


def test_the_sender_sends_its_key_to_the_bootstrap_server(hooked):
    url = hooked.start(api_key=KEY)
    assert _put(url, 0, KEY) == p.OK
    keyed = SglangEngine("http://127.0.0.1:9", bootstrap_url=url, api_key=KEY)
    assert keyed.transfer_engine_info(0)["remote_instance_transfer_engine_info"][0] == "203.0.113.9:1"
    with pytest.raises(Unauthorized, match="HTTP 401") as refused:
        SglangEngine("http://127.0.0.1:9", bootstrap_url=url, api_key=None).transfer_engine_info(0)
    assert "api_key=" in refused.value.hint


# -- one real server with --api-key -----------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    """A real tp=1 server with ``--api-key``, whose rank publishes at its bootstrap server (Mooncake
    over TCP; the weights live in host memory: sglang_plugin/weight_registration.py)."""
    root = tmp_path_factory.mktemp("sglang_plugin_info")
    model_dir = write_config("qwen3", str(root))
    bootstrap_port = free_port()
    server = start_sglang_server(model_dir, str(root / "server.log"), env={"MOONCAKE_PROTOCOL": "tcp"}, extra_args=(
        "--api-key", KEY, p.SEED_FLAG, "--engine-info-bootstrap-port", str(bootstrap_port)))
    try:
        server.wait_healthy()
        yield types.SimpleNamespace(server=server, url=server.url, bootstrap=f"http://127.0.0.1:{bootstrap_port}")
    finally:
        server.stop()


def test_a_real_server_with_a_key_reports_protocol_3_and_guards_its_bootstrap_server(keyed_server):
    url, bootstrap = keyed_server.url, keyed_server.bootstrap
    engine = SglangEngine(url, api_key=KEY)
    info = engine.server_info()
    assert info["version"] == version_guard.WRITTEN_FOR and info["device"] == "cpu"  # sglang's own server
    reported = info[p.PLUGIN_FIELD]
    assert (reported["version"], reported["protocol"]) == (p2pweights.__version__, 3), reported
    assert {p.PLUGIN_SESSIONS, p.PLUGIN_BOOTSTRAP_KEY} <= set(reported["offers"]) and "error" not in reported
    assert p.PLUGIN_GPU_ARCH not in reported and gpu_arch.KEY not in info  # a CPU server: no architecture anywhere
    assert {p.PLUGIN_SESSIONS, p.PLUGIN_BOOTSTRAP_KEY} <= engine.plugin_offers
    # without the key: refused on both routes; the probe stays open
    assert _get(bootstrap, 0)[0] == p.UNAUTHORIZED and _put(bootstrap, 5) == p.UNAUTHORIZED
    assert http.request("GET", bootstrap, "/health", timeout=5)[0] == p.OK
    # the rank published by itself, through the key (sglang's own PUT, hooked in its scheduler)
    status, published = _get(bootstrap, 0, KEY)
    assert status == p.OK, published
    session_id, table = published["remote_instance_transfer_engine_info"]
    assert table and all(len(entry) == 3 for entry in table.values()), published
    # sglang's proxy route reads the keyed bootstrap server (its GET carries the key)
    assert engine.transfer_engine_info(0) == published
    assert SglangEngine(url, bootstrap_url=bootstrap, api_key=KEY).transfer_engine_info(0) == published
    # with the key: a PUT is accepted
    assert _put(bootstrap, 5, KEY) == p.OK and _get(bootstrap, 5, KEY)[0] == p.OK
    with open(keyed_server.server.log_path, errors="replace") as f:
        log = f.read()
    assert "Failed to register transfer engine info" not in log and "without the key" not in log, log[-3000:]
