"""sender.update(step, adapter=name): a LoRA adapter written one-sided into the slot the engine gave it.

Real receiver engine processes with sglang's own LoRA pool on every rank (receiver/adapter_pool.py),
over Mooncake; the adapter is loaded once by the engine's own API (``/load_lora_adapter``, pinned), and
every byte of its slot is read back through Mooncake and compared with sglang's own load of the same
adapter files into a fresh LoRA manager (replica/lora_reference.py), at tp=1 and tp=2."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from p2pweights.control import SglangEngine
from p2pweights.errors import EngineError, P2PWeightsError, TornWeights, UpdateFailed
from p2pweights.receiver import start_engine
from p2pweights.replica.lora_layout import LoRASetting, buffer_name
from p2pweights.replica.lora_reference import (
    engine_buffer,
    engine_loads,
    engine_lora_manager,
    random_peft_adapter,
    sglang_lora_on_cpu,
    write_peft_adapter,
)
from p2pweights.sender import WeightSender, adapter_update
from p2pweights.transport.publication import EnginePublication
from replica_configs import write_config

SETTING = LoRASetting(max_lora_rank=8, max_loras_per_batch=3, lora_backend="torch_native")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_config("qwen3", str(tmp_path_factory.mktemp("adapter_cfg")))


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def engine(request, model):
    e = start_engine(model, f"tp={request.param}", transport="mooncake", name=f"lora-tp{request.param}", lora=SETTING,
                     startup_timeout=300)
    e.tp = request.param
    yield e
    e.close()


def _read_slot(url: str, rank: int, entry: str) -> np.ndarray:
    """The bytes of one published adapter slot entry of ``rank``, read through Mooncake."""
    from p2pweights.transport.mooncake import new_engine

    pub = EnginePublication.from_json(SglangEngine(url).transfer_engine_info(rank))
    where = pub.params[entry]
    te, _ = new_engine("127.0.0.1")
    buf = np.zeros(where.nbytes, dtype=np.uint8)
    assert te.register_memory(buf.ctypes.data, buf.nbytes, "*") == 0
    try:
        assert te.transfer_sync_read(pub.peer, buf.ctypes.data, where.data_ptr, buf.nbytes) == 0
    finally:
        te.unregister_memory(buf.ctypes.data)
    return buf


def _flip(url: str, rank: int, entry: str) -> None:
    from p2pweights.transport.mooncake import new_engine

    pub = EnginePublication.from_json(SglangEngine(url).transfer_engine_info(rank))
    te, _ = new_engine("127.0.0.1")
    buf = np.zeros(8, dtype=np.uint8)
    assert te.register_memory(buf.ctypes.data, buf.nbytes, "*") == 0
    try:
        addr = pub.params[entry].data_ptr
        assert te.transfer_sync_read(pub.peer, buf.ctypes.data, addr, 1) == 0
        buf[0] ^= 0x10
        assert te.transfer_sync_write(pub.peer, buf.ctypes.data, addr, 1) == 0
    finally:
        te.unregister_memory(buf.ctypes.data)


def _assert_equals_sglangs_own_load(engine, model, tp, slot, adapter_config, tensors, tmp_path):
    """Every rank's slot, byte for byte, equals sglang's own load of these adapter files."""
    path = write_peft_adapter(str(tmp_path / f"ref-{np.random.randint(1 << 30)}"), adapter_config, tensors)
    compared = 0
    with sglang_lora_on_cpu():
        for rank in range(tp):
            manager, context = engine_lora_manager(model, SETTING, f"tp={tp}", rank)
            ref_slot = engine_loads(manager, context, "ref", path)
            pool = manager.memory_pool
            for module in sorted(pool.A_buffer):
                for layer in range(len(pool.A_buffer[module])):
                    for side in ("A", "B"):
                        name = buffer_name(side, module, layer)
                        held = _read_slot(engine.url, rank, f"{name}@{slot}")
                        desc = type("B", (), {"side": side, "module": module, "layer": layer})
                        want = engine_buffer(manager, desc)[ref_slot].contiguous().view(-1).view(torch.uint8).numpy()
                        assert np.array_equal(held, want), (rank, name)
                        compared += 1
    assert compared > 0


def _load(client, model, tmp_path, name, seed):
    cfg, tensors = random_peft_adapter(model, r=4, seed=seed)
    answer = client.load_lora_adapter(name, write_peft_adapter(str(tmp_path / f"{name}-{seed}"), cfg, tensors))
    return answer["p2pw_slot"]


def test_an_adapter_update_is_byte_exact_on_every_rank_and_a_delta_writes_only_what_changed(engine, model, tmp_path):
    client = SglangEngine(engine.url, name=engine.name)
    slot = _load(client, model, tmp_path, "exact", seed=1)
    checksum = client.weights_checker("checksum")["per_engine_checksum"]
    version = client.weight_version()
    adapter_config, tensors = random_peft_adapter(model, r=4, seed=2)
    with WeightSender(model, transport="mooncake") as sender:
        sender.connect([client])
        with sender.update(1, adapter="exact", adapter_config=adapter_config, verify=True) as update:
            update.push_many(tensors)
        report = update.report
        assert report.slots == {engine.name: slot} and not report.delta[engine.name]
        assert report.bytes_written == report.bytes > 0
        _assert_equals_sglangs_own_load(engine, model, engine.tp, slot, adapter_config, tensors, tmp_path)

        # one element of one tensor changed: a delta, a few blocks, byte-exact again
        changed = {k: v.clone() for k, v in tensors.items()}
        first = sorted(changed)[0]
        changed[first][0, 0] += 1
        with sender.update(2, adapter="exact") as update:
            update.push_many(changed)
        report = update.report
        assert report.delta[engine.name], report.delta_reason
        assert 0 < report.bytes_written < report.bytes // 4
        _assert_equals_sglangs_own_load(engine, model, engine.tp, slot, adapter_config, changed, tmp_path)

    # the base weights and their version are untouched; the adapter has its own version
    assert client.weights_checker("checksum")["per_engine_checksum"] == checksum
    assert client.weight_version() == version
    state = client.server_info()["p2pw_weight_update"]
    assert state["adapters"]["exact"] == {"version": "2", "torn": None}
    client.unload_lora_adapter("exact")


def test_a_flipped_byte_fails_verify_the_adapter_stays_torn_until_a_complete_update_heals_it(
        engine, model, tmp_path, monkeypatch):
    client = SglangEngine(engine.url, name=engine.name)
    slot = _load(client, model, tmp_path, "flip", seed=3)
    adapter_config, tensors = random_peft_adapter(model, r=4, seed=4)
    entry = f"{buffer_name('B', 'o_proj', 1)}@{slot}"
    real = adapter_update.AdapterUpdate._verify

    def flip_then_verify(self, targets, entries):
        _flip(engine.url, engine.tp - 1, entry)
        return real(self, targets, entries)

    with WeightSender(model, transport="mooncake") as sender:
        sender.connect([client])
        monkeypatch.setattr(adapter_update.AdapterUpdate, "_verify", flip_then_verify)
        with pytest.raises(UpdateFailed) as failed:
            with sender.update(1, adapter="flip", adapter_config=adapter_config, verify=True) as update:
                update.push_many(tensors)
        assert entry in str(failed.value) and f"rank{engine.tp - 1}" in str(failed.value)
        state = client.server_info()["p2pw_weight_update"]
        assert state["adapters"]["flip"]["torn"], state
        with pytest.raises(TornWeights, match="flip"):  # nothing serves the half-written adapter
            client.continue_generation()
        monkeypatch.setattr(adapter_update.AdapterUpdate, "_verify", real)
        with sender.update(2, adapter="flip", verify=True) as update:  # a complete update heals it
            update.push_many(tensors)
        assert not update.report.delta[engine.name]  # the torn slot's base was forgotten: written whole
        _assert_equals_sglangs_own_load(engine, model, engine.tp, slot, adapter_config, tensors, tmp_path)
    assert client.server_info()["p2pw_weight_update"]["adapters"]["flip"] == {"version": "2", "torn": None}
    client.unload_lora_adapter("flip")


def test_an_adapter_the_engine_did_not_load_or_cannot_hold_is_refused_before_anything_is_paused(engine, model, tmp_path):
    client = SglangEngine(engine.url, name=engine.name)
    adapter_config, tensors = random_peft_adapter(model, r=4, seed=5)
    with WeightSender(model, transport="mooncake") as sender:
        sender.connect([client])
        with pytest.raises(EngineError, match="load_lora_adapter"):
            with sender.update(1, adapter="never-loaded", adapter_config=adapter_config) as update:
                update.push_many(tensors)
        assert client.server_info()["p2pw_weight_update"]["state"] == "none"
        wide_config, wide = random_peft_adapter(model, r=16, seed=6)  # above --max-lora-rank 8
        _load(client, model, tmp_path, "wide", seed=7)
        with pytest.raises(P2PWeightsError, match="max-lora-rank"):
            with sender.update(1, adapter="wide", adapter_config=wide_config) as update:
                update.push_many(wide)
        bad = {k: v.clone() for k, v in tensors.items()}
        bad[sorted(bad)[0]][0, 0] = float("nan")
        with pytest.raises(P2PWeightsError, match="NaN"):
            with sender.update(1, adapter="wide", adapter_config=adapter_config) as update:
                update.push_many(bad)
        assert client.server_info()["p2pw_weight_update"]["state"] == "none"
    client.unload_lora_adapter("wide")


def test_adapter_config_is_taken_as_peft_gives_it_a_dict_a_lora_config_or_a_path(tmp_path):
    """What a trainer holds: PEFT's LoraConfig (to_dict(), target_modules a set), the file or its
    folder, or the dict; anything else, or one without r / target_modules, refused by name."""
    import json

    from p2pweights.sender.adapter_update import adapter_config_dict

    want = {"r": 8, "lora_alpha": 16, "target_modules": ["k_proj", "q_proj"], "peft_type": "LORA"}

    class LoraConfigLike:  # PEFT's LoraConfig: a dataclass with to_dict(), target_modules a set
        def to_dict(self):
            return {**want, "target_modules": {"q_proj", "k_proj"}}

    (tmp_path / "adapter_config.json").write_text(json.dumps(want))
    assert adapter_config_dict(want, "a") == want
    assert adapter_config_dict(LoraConfigLike(), "a") == want
    assert adapter_config_dict(tmp_path, "a") == want
    assert adapter_config_dict(str(tmp_path / "adapter_config.json"), "a") == want
    with pytest.raises(P2PWeightsError, match="not a dict, PEFT's LoraConfig or a path") as e:
        adapter_config_dict(8, "a")
    assert e.value.parameter == "adapter_config"
    with pytest.raises(P2PWeightsError, match="has no r"):
        adapter_config_dict({"target_modules": ["q_proj"]}, "a")
    with pytest.raises(P2PWeightsError, match="cannot read adapter_config"):
        adapter_config_dict(tmp_path / "missing", "a")
