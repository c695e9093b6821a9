"""sender.update(step, adapter=name) into a stand-in vLLM 0.33 engine started with vLLM's LoRA, at tp=1 and tp=2.

The engine is tests/test_vllm_sender.py's stand-in (vLLM's own worker methods, backend, RL and dev
routers and the gate, real worker processes) with ``--enable-lora --max-lora-rank 8 --max-loras 2``:
each worker wraps its model with vLLM's own ``load_lora_model`` and registers and publishes its LoRA
tensors' slots (``vllm_backend/rank_lora.py``); the API server mounts vLLM's own
``/v1/load_lora_adapter`` over vLLM's ``OpenAIServingModels``. The adapter is loaded once by that API
(pinned: vLLM's ``pin_lora``); a sender process writes its slot one-sided over Mooncake with
``verify=True``. Every byte of every slot entry on every rank is read back through Mooncake and held
to vLLM's own load of the same adapter files (``replica/vllm_lora_reference.py``: the rank's model
built for real under a LoRA-enabled config, vLLM's ``LRUCacheWorkerLoRAManager.add_adapter``) in a
process of its own, from a config folder of its own."""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import pytest

from p2pweights.control import protocol as p
from replica_configs import write_config  # noqa: E402
from test_vllm_backend import STARTUP, Engine, end_child, read_json_line  # noqa: E402 (skips without vLLM)
from test_vllm_sender import standin  # noqa: E402

SETTING = {"max_lora_rank": 8, "max_loras": 2}

SENDER = r'''
import json, os, sys
out = os.fdopen(os.dup(1), "w")  # the result lines own stdout; what vLLM and Mooncake print goes to stderr
os.dup2(2, 1)
sys.stdout = sys.stderr
from safetensors.torch import load_file
from p2pweights import WeightSender
from p2pweights.control import VllmEngine
cfg, url, key = sys.argv[1:4]
sender = WeightSender(cfg, transport="mooncake")
sender.connect([VllmEngine(url, api_key=key)])
print(json.dumps({"event": "connected"}), file=out, flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    with open(os.path.join(cmd["path"], "adapter_config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(cmd["path"], "adapter_model.safetensors"))
    try:
        with sender.update(cmd["version"], adapter=cmd["adapter"], adapter_config=config, verify=True) as update:
            update.push_many(tensors)
        r = update.report
        print(json.dumps({"ok": True, "slots": r.slots, "delta": r.delta, "reason": r.delta_reason, "bytes": r.bytes,
                          "written": r.bytes_written}), file=out, flush=True)
    except Exception as e:
        print(json.dumps({"ok": False, "error": type(e).__name__, "message": str(e)}), file=out, flush=True)
sender.close()
'''

REFERENCE = r'''
import hashlib, json, os, sys, types
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
from p2pweights.replica.vllm_layout import VllmLayout
from p2pweights.replica.vllm_lora import VllmLoRASetting
from p2pweights.replica.vllm_lora_reference import engine_adds, engine_buffers, engine_tensor, engine_worker, vllm_lora_on_cpu
cfg, tp, setting, paths = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), json.loads(sys.argv[4])
found = {p: {} for p in paths}
with vllm_lora_on_cpu():
    for rank in range(tp):
        model, worker = engine_worker(cfg, VllmLoRASetting(**setting), VllmLayout.parse(f"tp={tp},dtype=bfloat16"), rank)
        for i, path in enumerate(paths):  # vLLM's own add_lora of the files: the slot it activated them into
            slot = engine_adds(model, worker, f"ref{i}", i + 1, path)
            held = {}
            for name in engine_buffers(worker):
                _, side, module, piece, layer = name.split(".")
                desc = types.SimpleNamespace(name=name, side=side, module=module, layer=int(layer[1:]))
                t = engine_tensor(worker, desc)[slot].contiguous().view(-1)
                held[name] = hashlib.sha256(t.view(__import__("torch").uint8).numpy().tobytes()).hexdigest()
            found[path][str(rank)] = held
print(json.dumps(found), file=out, flush=True)
'''


class LoraEngine(Engine):
    def slot_digests(self, rank: int, slot: int) -> dict[str, str]:
        """SHA-256 of every published slot entry ``lora.<buffer>@<slot>`` of ``rank``, read through Mooncake."""
        import numpy as np

        from p2pweights.transport.mooncake import new_engine
        from p2pweights.transport.publication import EnginePublication

        status, answer = self.call("GET", "/remote_instance_transfer_engine_info", params={"rank": rank})
        assert status == 200, answer
        pub = EnginePublication.from_json(answer)
        entries = sorted(n for n in pub.params if n.startswith("lora.") and n.endswith(f"@{slot}"))
        buf = np.zeros(sum(pub.params[n].nbytes for n in entries), dtype=np.uint8)
        te, _ = new_engine("127.0.0.1")
        assert te.register_memory(buf.ctypes.data, buf.nbytes, "*") == 0
        out, at = {}, 0
        try:
            for n in entries:
                size = pub.params[n].nbytes
                assert te.transfer_sync_read(pub.peer, buf.ctypes.data + at, pub.params[n].data_ptr, size) == 0
                out[n.rpartition("@")[0]] = hashlib.sha256(buf[at:at + size].tobytes()).hexdigest()
                at += size
        finally:
            te.unregister_memory(buf.ctypes.data)
        return out

    def client_of(self):
        from p2pweights.control import VllmEngine

        return VllmEngine(self.url, api_key=self.key, name=f"vllm-lora-tp{self.tp}")


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def engine(request, tmp_path_factory):
    from p2pweights.replica.vllm_lora import VllmLoRASetting

    root = tmp_path_factory.mktemp(f"vllm_lora_tp{request.param}")
    cfg = write_config("qwen3", str(root / "engine"))
    with standin(cfg, root, f"vllm-lora-tp{request.param}", LoraEngine, tp=request.param,
                 lora=VllmLoRASetting(**SETTING)) as running:
        running.tp = request.param
        running.root = root
        running.reference_cfg = write_config("qwen3", str(root / "reference"))  # nothing shared with the engine
        yield running


def adapter_files(engine: LoraEngine, name: str, seed: int, changed: bool = False) -> str:
    """A random PEFT adapter (r=4 of 8, alpha 8: vLLM folds 2x into B) as files; ``changed``: one
    element of its first tensor (layer 0's down_proj lora_A, by name) changed."""
    from p2pweights.replica.lora_reference import random_peft_adapter, write_peft_adapter

    with open(os.path.join(engine.cfg, "config.json")) as f:
        config = json.load(f)
    adapter_config, tensors = random_peft_adapter(config, r=4, alpha=8, seed=seed)
    if changed:
        tensors[sorted(tensors)[0]][0, 0] += 1
    return write_peft_adapter(str(engine.root / f"{name}-{seed}{'-changed' if changed else ''}"), adapter_config,
                              tensors)


class Sender:
    def __init__(self, engine: LoraEngine):
        self.proc = subprocess.Popen([sys.executable, "-c", SENDER, engine.cfg, engine.url, engine.key],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert read_json_line(self.proc, STARTUP) == {"event": "connected"}

    def update(self, version: str, adapter: str, path: str) -> dict:
        self.proc.stdin.write(json.dumps({"version": version, "adapter": adapter, "path": path}) + "\n")
        self.proc.stdin.flush()
        return read_json_line(self.proc, 600)

    def close(self) -> None:
        end_child(self.proc)


def references(engine: LoraEngine, paths: list[str]) -> dict:
    """vLLM's own load of each adapter folder, per rank: ``{path: {rank: {buffer: sha256}}}``."""
    proc = subprocess.run([sys.executable, "-c", REFERENCE, engine.reference_cfg, str(engine.tp), json.dumps(SETTING),
                           json.dumps(paths)], stdout=subprocess.PIPE, text=True, timeout=STARTUP)
    assert proc.returncode == 0, proc.returncode
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_an_adapter_update_equals_vllms_own_load_on_every_rank_and_a_delta_writes_only_what_changed(engine):
    client = engine.client_of()
    loaded = client.load_lora_adapter("exact", adapter_files(engine, "exact", seed=1))
    slot = loaded["p2pw_slot"]
    assert loaded["pinned"] and 0 <= slot < SETTING["max_loras"], loaded
    before, version = engine.checksums(), client.weight_version()
    first, second = adapter_files(engine, "exact", seed=2), adapter_files(engine, "exact", seed=2, changed=True)
    sender = Sender(engine)
    try:
        done = sender.update("1", "exact", first)
        assert done["ok"], done
        assert list(done["slots"].values()) == [slot] and done["delta"] == {e: False for e in done["slots"]}, done
        assert done["written"] == done["bytes"] > 0
        after_first = {r: engine.slot_digests(r, slot) for r in range(engine.tp)}
        done = sender.update("2", "exact", second)  # one element changed: a delta of a few 4 KiB blocks
        assert done["ok"] and all(done["delta"].values()), done
        assert 0 < done["written"] < done["bytes"] // 4, done
        after_second = {r: engine.slot_digests(r, slot) for r in range(engine.tp)}
    finally:
        sender.close()
    refs = references(engine, [first, second])
    for rank in range(engine.tp):
        assert len(after_first[rank]) == 28, sorted(after_first[rank])  # q, k, v, o, gate, up, down x 2 layers x A, B
        assert after_first[rank] == refs[first][str(rank)], f"rank {rank}: the full update differs from vLLM's load"
        assert after_second[rank] == refs[second][str(rank)], f"rank {rank}: the delta differs from vLLM's load"
    # the changed element (down_proj's A, row-parallel) lies in rank 0's columns: only rank 0's slot changed
    assert [after_first[r] != after_second[r] for r in range(engine.tp)] == [True] + [False] * (engine.tp - 1)
    # the base weights and their version are untouched; vLLM's start and finish never ran; the adapter's version
    assert engine.checksums() == before and client.weight_version() == version
    assert not {"start_weight_update", "finish_weight_update"} & set(engine.client.calls)
    state = engine.call("GET", "/p2pw_weight_update")[1]
    assert state["adapters"]["exact"] == {"version": "2", "torn": None} and state["state"] == "none", state
    assert engine.call("GET", "/is_paused")[1]["is_paused"] is False
    client.unload_lora_adapter("exact")  # pinned: vLLM's workers let go of it too


def test_an_adapter_vllm_did_not_load_or_did_not_pin_is_refused_and_the_engine_runs_on(engine):
    client = engine.client_of()
    path = adapter_files(engine, "loose", seed=3)
    client.load_lora_adapter("loose", path, pinned=False)
    version = client.weight_version()
    sender = Sender(engine)
    try:
        for adapter, why in (("never-loaded", "load_lora_adapter"), ("loose", "not pinned")):
            done = sender.update("1", adapter, path)
            assert not done["ok"] and why in done["message"] and "load_lora_adapter" in done["message"], done
            state = engine.call("GET", "/p2pw_weight_update")[1]
            assert state["state"] == "none" and adapter not in state.get("adapters", {}), state
            assert engine.call("GET", "/is_paused")[1]["is_paused"] is False  # the session's pause was undone
            assert client.weight_version() == version
    finally:
        sender.close()
    client.unload_lora_adapter("loose")


def test_a_lost_adapter_session_is_taken_over_with_the_lora_slots_revoked_and_the_adapter_torn(engine):
    import secrets
    import time

    client = engine.client_of()
    slot = client.load_lora_adapter("lost", adapter_files(engine, "lost", seed=4))["p2pw_slot"]
    dead, heir = secrets.token_urlsafe(32), secrets.token_urlsafe(32)

    def publications() -> list:
        from p2pweights.transport.publication import EnginePublication

        return [EnginePublication.from_json(engine.call("GET", "/remote_instance_transfer_engine_info",
                                                        params={"rank": r})[1]) for r in range(engine.tp)]

    before = publications()
    assert engine.call("POST", "/pause", owner=dead)[0] == 200
    status, begun = engine.call("POST", "/start_weight_update", {"adapter": "lost"}, owner=dead, lease=1)
    assert status == 200 and begun["adapter"] == {"name": "lost", "slot": slot}, begun
    time.sleep(1.5)  # the owner stops renewing: its lease lapses
    status, begun = engine.call("POST", "/start_weight_update", {"adapter": "lost"}, owner=heir)
    assert status == 200 and begun["took_over"], begun
    after = publications()
    for old, new in zip(before, after):  # every rank's registrations, LoRA slots included, under a new endpoint
        assert new.epoch == old.epoch + 1 and new.peer != old.peer
        slots = [n for n in new.params if n.startswith("lora.")]
        assert len(slots) == 28 * SETTING["max_loras"]
        assert all(new.params[n].data_ptr == old.params[n].data_ptr for n in slots)
        new.check_regions("vllm")  # every slot entry inside the memory registered anew
    assert all(engine.slot_digests(r, slot) for r in range(engine.tp))  # readable through the new endpoint
    status, answer = engine.call("POST", "/resume", owner=heir)  # the lost session's adapter may be half written
    assert status == p.CONFLICT and answer["error"]["type"] == "TornWeights" and "lost" in answer["error"]["message"]
    status, ended = engine.call("POST", "/finish_weight_update", {"adapter_version": "7"}, owner=heir)
    assert status == 200, ended
    assert engine.call("POST", "/resume", owner=heir)[0] == 200
    assert engine.call("GET", "/p2pw_weight_update")[1]["adapters"]["lost"] == {"version": "7", "torn": None}
    client.unload_lora_adapter("lost")
