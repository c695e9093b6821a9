"""A p2pweights update written into a REAL sglang 0.5.23 server: ``python -m sglang.launch_server``
(tp=1, a tiny Qwen3 with dummy weights, on the CPU through the plugin's ``p2pw_cpu`` platform)
started with sglang's own ``--remote-instance-weight-loader-start-seed-via-transfer-engine``. sglang
registers the rank's weights with its own Mooncake transfer engine (TCP, 127.0.0.1) and publishes
them at its engine-info bootstrap server; ``WeightSender`` connects through ``SglangEngine`` (the
proxy ``/remote_instance_transfer_engine_info``) and writes one-sided over Mooncake. Sessions go
through the plugin's gate.

What the server holds afterwards is read with sglang's own ``/weights_checker`` (action
``checksum``). On a CPU rank that is SHA-256 of each parameter's bytes (its first 8 bytes, in hex,
``sglang.srt.managers.mm_utils.tensor_hash``), under sglang's names, fused ones included
(``qkv_proj``, ``gate_up_proj``). The expected value is computed here, independently, from what
sglang's own ``load_weights`` makes of the same HF tensors (``replica.reference``). sglang's
``/get_weights_by_name`` cannot read a Qwen3: ``Qwen3ForCausalLM`` has no ``get_weights_by_name``,
and the route answers 400 "Get parameter by name failed".

The plugin is what lets a CPU server register its weights at all: without it, sglang's
``register_memory_region_v2`` asks torch's CUDA allocator for its memory snapshot and the scheduler
dies (``sglang_plugin/weight_registration.py``; the last test shows it on a plain server).
"""
from __future__ import annotations

import secrets
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import pytest

from conftest import require_sglang
from replica_configs import write_config
from sglang_server import log_tail, start_sglang_server, stop

require_sglang()  # skips without sglang; fails in CI

import torch  # noqa: E402

from p2pweights.control import SglangEngine, http  # noqa: E402
from p2pweights.control import protocol as p  # noqa: E402
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint  # noqa: E402
from p2pweights.models.engine_layout import EngineLayout  # noqa: E402
from p2pweights.sender import WeightSender  # noqa: E402
from p2pweights.sglang_plugin import weight_registration  # noqa: E402
from p2pweights.sglang_plugin.weight_checksums import ExpectedChecksums, engine_checksums  # noqa: E402

STARTUP_TIMEOUT_S = 600.0  # the harness's 300 s is too short while other suites load this 2-core host
FUSED = ("model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight")


def start_seed_server(model_dir: str, log_path: str, env: dict[str, str] | None = None):
    """A real server publishing its weights over Mooncake (sglang's seed flag; TCP on 127.0.0.1), on a
    bootstrap port of its own (not 6789: other servers may run on this host)."""
    return start_sglang_server(model_dir, log_path, env=env, seed_via_mooncake=True)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The module's two real servers, started together (their start-ups overlap): one with the plugin,
    and a plain one (``SGLANG_PLUGINS`` names another plugin)."""
    root = tmp_path_factory.mktemp("sglang_update")
    model_dir = write_config("qwen3", str(root))
    plain = start_seed_server(model_dir, str(root / "plain.log"), env={"SGLANG_PLUGINS": "none-such"})
    server = start_seed_server(model_dir, str(root / "server.log"))
    try:
        yield SimpleNamespace(server=server, plain=plain, model_dir=model_dir)
    finally:
        stop([plain, server])


@pytest.fixture(scope="module")
def seeded(servers):
    servers.server.wait_healthy(timeout=STARTUP_TIMEOUT_S)
    engine = SglangEngine(servers.server.url, name="real", timeout=60)
    sender = WeightSender(servers.model_dir, transport="mooncake", buffer_size=1 << 20)
    try:
        sender.connect([engine])
        yield SimpleNamespace(server=servers.server, model_dir=servers.model_dir, engine=engine, sender=sender)
    finally:
        sender.close()


_EXPECTED: dict[int, dict[str, str]] = {}


def expected(model_dir: str, seed: int) -> dict[str, str]:
    """Each parameter's checksum after sglang's own loader took ``random_checkpoint(.., seed)`` and its
    update session's post-processing ran (a tp=1 rank; ``sglang_plugin.weight_checksums``)."""
    if seed not in _EXPECTED:
        _EXPECTED[seed] = ExpectedChecksums(model_dir, EngineLayout.parse("tp=1")).of(seed)[0]
    return _EXPECTED[seed]


def engine_digests(engine: SglangEngine) -> dict[str, str]:
    """sglang's own checksums of the server's one rank."""
    by_rank = engine_checksums(engine)
    assert list(by_rank) == [0], by_rank.keys()
    return by_rank[0]


def update(seeded, version: str, seed: int, during=None):
    """One update with the sender's own session; ``during(seeded)`` runs once every tensor was pushed,
    before the update ends."""
    with seeded.sender.update(version) as u:
        for name, t in random_checkpoint(checkpoint_tensors(seeded.model_dir), seed):
            u.push(name, t)
        if during is not None:
            during(seeded)
    assert [e.state for e in u.report.engines] == ["ok"] and u.report.engines[0].bytes > 0, u.report
    return u.report


def session_is_the_senders(seeded) -> None:
    state = seeded.server.get_json("/server_info")["p2pw_weight_update"]
    assert state["state"] == "open", state
    other = secrets.token_urlsafe(32)
    status, answer = http.request("POST", seeded.server.url, "/continue_generation", body={},
                                  headers={p.SESSION_OWNER_HEADER: other}, timeout=60)
    assert status == p.CONFLICT and answer["error"]["type"] == "SessionConflict", answer


def test_the_server_publishes_its_weights_over_mooncake_on_loopback(seeded):
    published = seeded.engine.transfer_engine_info(0)["remote_instance_transfer_engine_info"]
    session_id, table = published
    assert session_id.startswith("127.0.0.1:"), session_id
    assert set(FUSED) <= set(table) and set(table) == set(expected(seeded.model_dir, 1))


def test_a_full_update_is_byte_exact_in_the_real_server_and_a_second_too(seeded):
    want1, want2 = expected(seeded.model_dir, 1), expected(seeded.model_dir, 2)
    assert want1.keys() == want2.keys() and all(want1[n] != want2[n] for n in want1)
    before = engine_digests(seeded.engine)  # sglang's dummy weights: the check can fail
    assert before.keys() == want1.keys() and all(before[n] != want1[n] for n in FUSED)

    update(seeded, "v1", 1, during=session_is_the_senders)
    assert seeded.engine.weight_version() == "v1"
    assert seeded.server.get_json("/server_info")["p2pw_weight_update"]["state"] == "none"
    got = engine_digests(seeded.engine)
    assert {n: got[n] for n in FUSED} == {n: want1[n] for n in FUSED}
    assert got == want1

    update(seeded, "v2", 2)
    assert seeded.engine.weight_version() == "v2"
    assert engine_digests(seeded.engine) == want2


# -- the hook, in this process ---------------------------------------------------------------------
class RecordingEngine:
    """Mooncake's ``TransferEngine.register_memory(addr, nbytes)`` as sglang calls it: recorded."""

    def __init__(self, answer: int = 0):
        self.registered: list[tuple[int, int]] = []
        self.answer = answer

    def register_memory(self, addr: int, nbytes: int) -> int:
        self.registered.append((addr, nbytes))
        return self.answer


def host_model() -> torch.nn.Module:
    """Two parameters that touch in one allocation, and one of its own."""
    model = torch.nn.Module()
    block = torch.zeros(48, dtype=torch.bfloat16)
    model.a = torch.nn.Parameter(block[:16])
    model.b = torch.nn.Parameter(block[16:48])
    model.c = torch.nn.Parameter(torch.zeros(8, dtype=torch.float32))
    return model


def test_host_weights_are_registered_merged_where_they_touch_and_published_as_sglang_does():
    model, engine = host_model(), RecordingEngine()
    table = weight_registration.register_memory_region(pytest.fail, model, engine)
    assert table == {n: (q.data_ptr(), q.numel(), q.element_size()) for n, q in model.named_parameters()}
    assert sorted(engine.registered) == sorted([(model.a.data_ptr(), 96), (model.c.data_ptr(), 32)])


def test_weights_not_in_host_memory_are_left_to_sglang_and_a_refusal_raises():
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.empty(4, device="meta"))  # stands in for a CUDA parameter
    calls = []
    assert weight_registration.register_memory_region(lambda m, e: calls.append((m, e)) or "sglang's", model,
                                                      "engine") == "sglang's"
    assert calls == [(model, "engine")]
    with pytest.raises(RuntimeError, match="register memory failed for weight block"):
        weight_registration.register_memory_region(pytest.fail, host_model(), RecordingEngine(answer=-1))


def test_the_hooked_function_is_sglangs_and_only_schedulers_hook_it(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from p2pweights import sglang_plugin
    from p2pweights.replica import sglang_env
    from p2pweights.sglang_plugin import version_guard

    sglang_env.prepare()  # sglang's model loader imports torchvision: under the replica's stubs here
    target = weight_registration.TARGET
    assert version_guard.mismatch(target, version_guard.HOOKED[target]) is None
    assert target in version_guard.hooked_in("scheduler") and target not in version_guard.hooked_in("detokenizer")
    monkeypatch.setattr(version_guard, "HOOKED", {target: version_guard.HOOKED[target]})
    calls: list[tuple] = []
    monkeypatch.setattr(HookRegistry, "register", classmethod(lambda cls, t, hook, hook_type, **kw: calls.append(
        (t, hook, hook_type))))

    def run_scheduler_process():  # named as sglang's scheduler entry, which calls load_plugins()
        sglang_plugin.register()

    run_scheduler_process()
    assert (target, weight_registration.register_memory_region, HookType.AROUND) in calls
    calls.clear()
    sglang_plugin.register()  # kind main: the launcher holds no model
    assert all(t != target for t, _, _ in calls)


# -- a plain server ----------------------------------------------------------------------------------
def test_a_plain_cpu_server_cannot_register_its_weights_with_mooncake(servers):
    """Without the plugin, sglang 0.5.23's own registration (``register_memory_region_v2``) reads the
    CUDA allocator's snapshot, which a CPU build of torch lacks: the scheduler dies before the server
    is healthy. Should sglang ever register host memory itself, this fails: then a plain server's
    update belongs here."""
    plain = servers.plain
    deadline = plain.started + STARTUP_TIMEOUT_S
    while plain.proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(plain.url + "/health", timeout=5) as r:
                if r.status == 200:
                    pytest.fail("a plain CPU server started with the Mooncake seed flag is healthy: "
                                "sglang now registers host memory itself", pytrace=False)
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        time.sleep(0.5)
    log = log_tail(plain.log_path, lines=400)
    assert plain.proc.poll() is not None, f"still starting after {STARTUP_TIMEOUT_S:.0f} s:\n{log[-3000:]}"
    assert "register_memory_region_v2" in log and "_cuda_memorySnapshot" in log, log[-3000:]
