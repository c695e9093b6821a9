"""LoRA adapter updates (docs/lora.md, "Adapter updates") into a REAL sglang 0.5.23 server with the plugin
(``python -m sglang.launch_server --enable-lora ... --lora-backend torch_native``, tp=1 and tp=2, a tiny
Qwen3 on the CPU through the ``p2pw_cpu`` platform, real safetensors weights: sglang's adapter load reads
files with the server's load format, which ``dummy`` refuses), its weights published over Mooncake.

The plugin registers each rank's LoRA pool with the rank's Mooncake endpoint and publishes every adapter
slot (sglang_plugin/lora_slots.py); sglang's own ``/load_lora_adapter`` goes through the session gate to
the engine core; the begin of an adapter session asks every rank's scheduler for the adapter's slot
(placed as a batch would place it; refused when not loaded or not pinned) and runs none of sglang's
weight-update work. What every rank holds afterwards is read back through Mooncake and compared, byte
for byte, with sglang's own load of the same adapter files into a fresh LoRA manager of that rank
(replica/lora_reference.py), as tests/test_adapter_update.py does for our receiver.
"""
from __future__ import annotations

import secrets
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import require_sglang
from replica_configs import write_config
from sglang_server import free_port, start_sglang_server

require_sglang()  # skips without sglang; fails in CI

from p2pweights.control import SglangEngine, http  # noqa: E402
from p2pweights.control import protocol as p  # noqa: E402
from p2pweights.errors import EngineError  # noqa: E402
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint  # noqa: E402
from p2pweights.replica.lora_reference import random_peft_adapter, write_peft_adapter  # noqa: E402
from p2pweights.sender import WeightSender  # noqa: E402
from p2pweights.transport.publication import EnginePublication  # noqa: E402
from test_adapter_update import SETTING, _assert_equals_sglangs_own_load  # noqa: E402

STARTUP_TIMEOUT_S = 900.0  # a shared 2-core host under other suites' load
MOONCAKE_ENV = {"MOONCAKE_PROTOCOL": "tcp", "SGLANG_HOST_IP": "127.0.0.1"}
LORA_FLAGS = ("--enable-lora", "--max-lora-rank", str(SETTING.max_lora_rank),
              "--max-loras-per-batch", str(SETTING.max_loras_per_batch),
              "--lora-target-modules", *SETTING.target_modules, "--lora-backend", SETTING.lora_backend,
              "--load-format", "auto")  # after the CPU flags' "dummy": sglang's adapter load reads files


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def served(request, tmp_path_factory):
    from safetensors.torch import save_file

    tp = request.param
    root = tmp_path_factory.mktemp(f"sglang_lora_tp{tp}")
    # sglang on the CPU pads an intermediate size that tp * 32 does not divide (96 -> 128 at tp=2), which a
    # GPU rank (and the sender's replica) does not: 128 keeps the CPU ranks' shapes a GPU rank's
    model_dir = write_config("qwen3", str(root), intermediate_size=128)
    save_file({n: t.contiguous() for n, t in random_checkpoint(checkpoint_tensors(model_dir), 7)},
              f"{model_dir}/model.safetensors")
    server = start_sglang_server(model_dir, str(root / "server.log"), tp=tp, env=MOONCAKE_ENV,
                                 extra_args=(p.SEED_FLAG, "--engine-info-bootstrap-port", str(free_port()),
                                             *LORA_FLAGS))
    try:
        server.wait_healthy(timeout=STARTUP_TIMEOUT_S)
        engine = SglangEngine(server.url, name=f"sglang-lora-tp{tp}", timeout=120)
        yield SimpleNamespace(server=server, url=server.url, model_dir=model_dir, tp=tp, engine=engine)
    finally:
        server.stop()


def _load(served, tmp_path, name: str, seed: int, pinned: bool = True) -> dict:
    cfg, tensors = random_peft_adapter(served.model_dir, r=4, seed=seed)
    return served.engine.load_lora_adapter(name, write_peft_adapter(str(tmp_path / f"{name}-{seed}"), cfg, tensors),
                                           pinned=pinned)


def _state(served) -> dict:
    return served.engine.server_info()["p2pw_weight_update"]


def test_every_rank_publishes_its_lora_pool_slots(served):
    slots = SETTING.max_loras_per_batch
    for rank in range(served.tp):
        pub = EnginePublication.from_json(served.engine.transfer_engine_info(rank))
        entries = sorted(n for n in pub.params if n.startswith("lora."))
        assert entries and {int(n.rpartition("@")[2]) for n in entries} == set(range(1, slots)), entries[:4]
        assert "lora.A.qkv_proj.L0@1" in entries and "lora.B.down_proj.L1@2" in entries
        weights = [(t.data_ptr, t.nbytes) for n, t in pub.params.items() if not n.startswith("lora.")]
        for name in entries:  # apart from every weight
            a, n = pub.params[name].data_ptr, pub.params[name].nbytes
            assert all(a + n <= s or s + m <= a for s, m in weights), name


def test_an_adapter_update_is_byte_exact_on_every_rank_and_a_delta_writes_less(served, tmp_path):
    engine = served.engine
    loaded = _load(served, tmp_path, "exact", seed=1)
    assert loaded["success"] is True and isinstance(loaded.get("p2pw_slot"), int), loaded
    slot = loaded["p2pw_slot"]
    checksum = engine.weights_checker("checksum")["per_engine_checksum"]
    version = engine.weight_version()
    adapter_config, tensors = random_peft_adapter(served.model_dir, r=4, seed=2)
    with WeightSender(served.model_dir, transport="mooncake") as sender:
        sender.connect([engine])
        with sender.update(1, adapter="exact", adapter_config=adapter_config, verify=True) as update:
            update.push_many(tensors)
        report = update.report
        assert report.slots == {engine.name: slot} and not report.delta[engine.name]
        assert report.bytes_written == report.bytes > 0
        _assert_equals_sglangs_own_load(served, served.model_dir, served.tp, slot, adapter_config, tensors, tmp_path)

        changed = {k: v.clone() for k, v in tensors.items()}  # one element of one tensor: a few blocks
        changed[sorted(changed)[0]][0, 0] += 1
        with sender.update(2, adapter="exact", verify=True) as update:
            update.push_many(changed)
        report = update.report
        assert report.delta[engine.name], report.delta_reason
        assert 0 < report.bytes_written < report.bytes // 4, (report.bytes_written, report.bytes)
        _assert_equals_sglangs_own_load(served, served.model_dir, served.tp, slot, adapter_config, changed, tmp_path)

    # sglang's base weights and their version untouched; the adapter has its own version; it serves
    assert engine.weights_checker("checksum")["per_engine_checksum"] == checksum
    assert engine.weight_version() == version
    assert _state(served)["adapters"]["exact"] == {"version": "2", "torn": None}
    status, answer = http.request("POST", served.url, "/generate", timeout=120, body={
        "input_ids": [5, 6, 7], "lora_path": "exact", "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert status == p.OK and len(answer["output_ids"]) == 2, answer
    engine.unload_lora_adapter("exact")


def test_a_not_loaded_or_unpinned_adapter_is_refused_before_anything_is_written(served, tmp_path):
    engine = served.engine
    adapter_config, tensors = random_peft_adapter(served.model_dir, r=4, seed=5)
    _load(served, tmp_path, "loose", seed=6, pinned=False)
    with WeightSender(served.model_dir, transport="mooncake") as sender:
        sender.connect([engine])
        with pytest.raises(EngineError, match="load_lora_adapter") as refused:
            with sender.update(1, adapter="never-loaded", adapter_config=adapter_config) as update:
                update.push_many(tensors)
        assert "is not loaded" in str(refused.value), refused.value
        assert _state(served)["state"] == "none"
        with pytest.raises(EngineError, match="pinned=True") as refused:
            with sender.update(1, adapter="loose", adapter_config=adapter_config) as update:
                update.push_many(tensors)
        assert "unpinned" in str(refused.value), refused.value
        assert _state(served)["state"] == "none"
    status, answer = http.request("POST", served.url, "/generate", timeout=120, body={
        "input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
    assert status == p.OK, answer  # generation was continued
    engine.unload_lora_adapter("loose")


def _read(peer: str, address: int, nbytes: int) -> np.ndarray | None:
    """``nbytes`` at ``address`` of the rank behind Mooncake session ``peer`` (None: refused)."""
    from p2pweights.transport.mooncake import new_engine

    te, _ = new_engine("127.0.0.1")
    buf = np.zeros(nbytes, dtype=np.uint8)
    assert te.register_memory(buf.ctypes.data, buf.nbytes, "*") == 0
    try:
        return buf if te.transfer_sync_read(peer, buf.ctypes.data, address, nbytes) == 0 else None
    finally:
        te.unregister_memory(buf.ctypes.data)


def test_a_takeover_of_a_lost_adapter_session_revokes_the_pool_with_the_weights(served, tmp_path):
    """Another controller's adapter session, given up (torn), is taken over by the sender's update: every
    rank moves its registrations, the LoRA pool's included, to a new endpoint under the next epoch; the
    old endpoint reaches no slot any more and the new one holds the update, byte-exact."""
    engine = served.engine
    slot = _load(served, tmp_path, "fenced", seed=8)["p2pw_slot"]
    entry = f"lora.B.o_proj.L1@{slot}"
    old = {r: EnginePublication.from_json(engine.transfer_engine_info(r)) for r in range(served.tp)}
    assert all(_read(pub.peer, pub.params[entry].data_ptr, 16) is not None for pub in old.values())
    epoch = _state(served)["epoch"]

    other = {p.SESSION_OWNER_HEADER: secrets.token_urlsafe(32)}
    for path, body in (("/pause_generation", {}), ("/begin_weight_update", {"adapter": "fenced"}),
                       ("/renew_weight_update", {"release": True})):
        status, answer = http.request("POST", served.url, path, body=body, headers=other, timeout=120)
        assert p.ok(status), (path, answer)
    assert _state(served)["adapters"]["fenced"]["torn"], _state(served)

    adapter_config, tensors = random_peft_adapter(served.model_dir, r=4, seed=9)
    with WeightSender(served.model_dir, transport="mooncake") as sender:
        sender.connect([engine])
        with sender.update(1, adapter="fenced", adapter_config=adapter_config, verify=True) as update:
            update.push_many(tensors)
    assert update.report.slots == {engine.name: slot}
    state = _state(served)
    assert state["state"] == "none" and state["epoch"] == epoch + 1, state
    assert state["adapters"]["fenced"] == {"version": "1", "torn": None}
    for rank, before in old.items():
        now = EnginePublication.from_json(engine.transfer_engine_info(rank))
        assert now.epoch == epoch + 1 and now.peer != before.peer and now.params == before.params
        assert _read(before.peer, before.params[entry].data_ptr, 16) is None  # the old epoch reaches nothing
    _assert_equals_sglangs_own_load(served, served.model_dir, served.tp, slot, adapter_config, tensors, tmp_path)
    engine.unload_lora_adapter("fenced")


def test_a_base_weights_update_on_a_lora_server_is_verified_and_leaves_the_adapter_alone(served, tmp_path):
    """sglang wraps the LoRA target layers after the rank published its weights (their parameters become
    ``...base_layer.weight`` in the model): the digest still answers the published names, and a base update
    touches no adapter slot."""
    engine = served.engine
    slot = _load(served, tmp_path, "kept", seed=12)["p2pw_slot"]
    adapter_config, tensors = random_peft_adapter(served.model_dir, r=4, seed=13)
    with WeightSender(served.model_dir, transport="mooncake") as sender:
        sender.connect([engine])
        with sender.update(1, adapter="kept", adapter_config=adapter_config) as update:
            update.push_many(tensors)
        with sender.update("base-11", verify=True) as update:
            for name, t in random_checkpoint(checkpoint_tensors(served.model_dir), 11):
                update.push(name, t)
        assert update.report.engines and {e.state for e in update.report.engines} == {"ok"}, update.report
    assert engine.weight_version() == "base-11"
    assert _state(served)["adapters"]["kept"] == {"version": "1", "torn": None}
    _assert_equals_sglangs_own_load(served, served.model_dir, served.tp, slot, adapter_config, tensors, tmp_path)
    engine.unload_lora_adapter("kept")
