"""A real sender (WeightSender.connect / update / push) takes a vLLM 0.33 engine the way it takes an
sglang one (control/vllm.py ``VllmEngine``, sender/engine_kinds.py): the stand-in engine of
tests/test_vllm_backend.py (vLLM's own worker methods, backend, RL and dev routers and the gate, over
uvicorn, a real worker process), a sender process that reads the engine's layout from vLLM's
``/server_info`` and ``/get_world_size``, builds vLLM replicas for it and writes over real Mooncake.
The engine's parameters are judged by vLLM's own ``/weight_checker`` checksums against a fresh CPU
vLLM load of the same checkpoint in a third process.

The stand-in API server has no ``AsyncLLM``: vLLM's ``/server_info`` and ``/get_world_size`` read
``app.state.vllm_config`` and ``engine_client.vllm_config``, which vLLM's API server sets; the
fixture sets them to the worker's own config (``cpu_worker.engine_config``)."""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from typing import Iterator

import pytest

from replica_configs import write_config  # noqa: E402
from test_vllm_backend import STARTUP, Engine, end_child, free_port, read_json_line  # noqa: E402 (skips without vLLM)

SENDER = r'''
import json, os, sys
out = os.fdopen(os.dup(1), "w")  # the result lines own stdout; what vLLM and Mooncake print goes to stderr
os.dup2(2, 1)
sys.stdout = sys.stderr
from p2pweights import WeightSender
from p2pweights.control import VllmEngine
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
import p2pweights.sender.verify as update_module  # verify_update calls verify_written
cfg, url, key = sys.argv[1:4]
sender = WeightSender(cfg, transport="mooncake")
engine = VllmEngine(url, api_key=key)
sender.connect([engine])
layout = sender.prepared[0].replica.engine
print(json.dumps({"event": "connected", "layout": layout.describe(), "kind": layout.kind}), file=out, flush=True)
verify_written, flip = update_module.verify_written, {"on": False}

def held_then_verified(*args, **kwargs):  # the writes returned; the test may flip an engine byte now
    if flip["on"]:
        print(json.dumps({"event": "written"}), file=out, flush=True)
        sys.stdin.readline()
    return verify_written(*args, **kwargs)

update_module.verify_written = held_then_verified
for line in sys.stdin:
    cmd = json.loads(line)
    flip["on"] = cmd["flip"]
    changed = tuple(cmd["changed"]) if cmd["changed"] else None
    try:
        with sender.update(version=cmd["version"], verify=True) as update:
            for name, tensor in random_checkpoint(checkpoint_tensors(cfg), cmd["seed"], changed=changed):
                update.push(name, tensor)
        r = update.report
        ranks = [{"delta": e.delta, "reason": e.delta_reason, "bytes": e.bytes, "written": e.bytes_written}
                 for e in r.engines]
        print(json.dumps({"ok": True, "ranks": ranks}), file=out, flush=True)
    except Exception as e:
        print(json.dumps({"ok": False, "error": type(e).__name__, "message": str(e)}), file=out, flush=True)
sender.close()
'''

REFERENCE = r'''
import json, os, sys
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
from p2pweights.vllm_backend import cpu_worker
cfg, dist_port, wanted = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
vc = cpu_worker.engine_config(cfg)
model = cpu_worker.build_model(vc, cfg, wanted[0][0], dist_port)
digests = []
for seed, changed in wanted:  # a fresh vLLM load of each checkpoint, as /weight_checker hashes it
    with set_current_vllm_config(vc):
        model.load_weights(random_checkpoint(checkpoint_tensors(cfg), seed, changed=tuple(changed) if changed else None))
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    digests.append(compute_tensor_digests(model))
print(json.dumps(digests), file=out, flush=True)
'''

CORRUPT = r'''
import json, sys, time
import numpy as np
from p2pweights.transport import make_backend
from p2pweights.transport.publication import EnginePublication
name, value = sys.argv[1], int(sys.argv[2])
pub = EnginePublication.from_json(json.loads(sys.stdin.readline()))
byte = np.array([value], dtype=np.uint8)
be = make_backend(pub.transport)
be.register_memory(byte.ctypes.data, 1, "cpu")
be.connect(0, pub.descriptor)
req = be.post(0, [byte.ctypes.data], [pub.params[name].data_ptr], [1])
while be.poll(req) == 1:
    time.sleep(0.001)
print(json.dumps({"status": be.poll(req)}), flush=True)
'''

FLIPPED = "model.norm.weight"  # vLLM's RMSNorm holds the HF tensor's bytes as they are
CHANGED = [0.02, 1]            # version 1 of seed 3's changed family: about 2% of the bytes differ


class SenderProcess:
    """:data:`SENDER` in a process of its own, driven one update at a time (the vLLM sender tests')."""

    def __init__(self, engine: Engine):
        self.proc = subprocess.Popen([sys.executable, "-c", SENDER, engine.cfg, engine.url, engine.key],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def connected(self) -> dict:
        return read_json_line(self.proc, STARTUP)

    def update(self, version: str, seed: int, changed=None, flip=None) -> dict:
        """One ``update(verify=True)`` of checkpoint ``seed``; ``flip``: called once the writes returned,
        before verify (the test changes an engine byte there)."""
        cmd = {"version": version, "seed": seed, "changed": changed, "flip": flip is not None}
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        if flip is not None:
            assert read_json_line(self.proc, 600) == {"event": "written"}
            flip()
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        return read_json_line(self.proc, 600)

    def close(self) -> None:
        end_child(self.proc)


@contextlib.contextmanager
def standin(cfg: str, root, name: str, engine_cls: type = Engine, **layout) -> Iterator[Engine]:
    """A stand-in vLLM engine of ``cfg`` (``layout``: ``tp``, ``dp``, ``spec``), ready and registered,
    as the tests' ``engine_cls``; its log in ``root``; closed on exit."""
    from p2pweights.vllm_backend.standin_engine import StandInVllmEngine

    running = StandInVllmEngine(cfg, str(root / "engine.log"), name, **layout)
    try:
        running.wait_ready(STARTUP)  # vLLM's /server_info and /get_world_size answer from the worker's config
        yield engine_cls(url=running.url, key=running.api_key, client=running.client, cfg=cfg, app=running.app)
    finally:
        running.close()


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_sender_cfg")
    with standin(write_config("qwen3", str(root)), root, "vllm-sender") as running:
        yield running


def references(engine: Engine, wanted: list) -> list[dict[str, str]]:
    proc = subprocess.run([sys.executable, "-c", REFERENCE, engine.cfg, str(free_port()), json.dumps(wanted)],
                          stdout=subprocess.PIPE, text=True, timeout=STARTUP)
    assert proc.returncode == 0, proc.returncode
    return json.loads(proc.stdout.strip().splitlines()[-1])


def flip_one_byte(engine: Engine, seed: int) -> None:
    """One byte of ``FLIPPED`` in the engine's memory made to differ from checkpoint ``seed``'s, by a
    one-sided Mooncake write of a third process (the engine now holds what no sender wrote)."""
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint

    tensor = dict(random_checkpoint(checkpoint_tensors(engine.cfg), seed))[FLIPPED]
    value = int(tensor.contiguous().view(-1).view(__import__("torch").uint8)[0]) ^ 0xFF
    proc = subprocess.run([sys.executable, "-c", CORRUPT, FLIPPED, str(value)], text=True, timeout=300,
                          input=json.dumps(engine.publication().to_dict()) + "\n", stdout=subprocess.PIPE)
    assert proc.returncode == 0 and json.loads(proc.stdout.strip().splitlines()[-1])["status"] == 0, proc.stdout


def test_a_sender_updates_a_vllm_engine_verifies_it_and_sends_deltas_after(engine):
    wanted = [[2, None], [3, None], [3, CHANGED]]
    sender = SenderProcess(engine)
    try:
        refs = references(engine, wanted)  # beside the sender's imports and replica build
        connected = sender.connected()
        assert connected == {"event": "connected", "layout": "vllm:tp=1,dtype=bfloat16", "kind": "vllm"}, connected
        update = sender.update

        before = engine.checksums()
        # 1. a full update (the sender's first: no base), verify=True's digests agree
        done = update("1", 2)
        assert done["ok"] and not done["ranks"][0]["delta"], done
        assert engine.checksums() == refs[0] != before
        assert engine.call("GET", "/weight_info")[1]["weight_version"] == "1"
        assert engine.call("GET", "/is_paused")[1]["is_paused"] is False
        # 2. one byte flipped in the engine after the writes: verify names it, the engine stays paused
        failed = update("2", 3, flip=lambda: flip_one_byte(engine, 3))
        assert not failed["ok"] and failed["error"] == "UpdateFailed" and FLIPPED in failed["message"], failed
        assert engine.call("GET", "/is_paused")[1]["is_paused"] is True
        assert engine.call("GET", "/weight_info")[1]["weight_version"] == "1"
        held = engine.checksums()
        assert held != refs[1] and {n for n in held if held[n] != refs[1][n]} == {FLIPPED}
        # 3. the next update heals it (the base was forgotten: a full write)
        done = update("3", 3)
        assert done["ok"] and not done["ranks"][0]["delta"] and done["ranks"][0]["reason"], done
        assert engine.checksums() == refs[1]
        # 4. a second update after a good commit goes as deltas into the engine's delta area
        done = update("4", 3, changed=CHANGED)
        rank = done["ranks"][0]
        assert done["ok"] and rank["delta"] and rank["written"] < rank["bytes"] // 4, done
        assert engine.checksums() == refs[2] != refs[1]
        assert engine.call("GET", "/weight_info")[1]["weight_version"] == "4"
    finally:
        sender.close()


def test_a_vllm_engine_without_the_key_or_with_a_wrong_layout_is_refused_before_any_replica(engine):
    from p2pweights.control import VllmEngine
    from p2pweights.errors import EngineError, EngineMismatch, LayoutMismatch, Unauthorized, UnsupportedLayout
    from p2pweights.sender.engine_kinds import layout_and_identity, layout_of, vllm_layout

    with pytest.raises(Unauthorized):
        VllmEngine(engine.url, api_key="wrong-" + engine.key).server_info()
    wrong = VllmEngine(engine.url, api_key=engine.key, layout="tp=2")
    with pytest.raises(LayoutMismatch, match="runs 1 rank"):
        layout_and_identity(wrong, wrong.server_info(), {})  # what connect asks first
    right = VllmEngine(engine.url, api_key=engine.key)
    info = right.server_info()
    assert vllm_layout(right, info).describe() == "vllm:tp=1,dtype=bfloat16"
    # an engine of another vLLM release, or answering something that is not vLLM's config: refused
    with pytest.raises(EngineMismatch, match="vLLM 0.0.1"):
        layout_and_identity(right, {**info, "vllm_version": "0.0.1"}, {})
    for forged in ({"vllm_config": {"parallel_config": {"tensor_parallel_size": "two"}}}, {"vllm_config": []},
                   {"vllm_config": {"parallel_config": {}, "model_config": "x"}},
                   {"vllm_config": {"parallel_config": {}, "speculative_config": "mtp"}}):
        with pytest.raises(EngineError):
            layout_of(forged, right.name)
    # a draft from a separate checkpoint (EAGLE) is one no trainer's sender keeps current: refused, named
    server = info["vllm_server_info"]
    eagle = {**server, "vllm_config": {**server["vllm_config"], "speculative_config": {"method": "eagle"}}}
    with pytest.raises(UnsupportedLayout, match="eagle"):
        layout_of(eagle, right.name)
    mtp = {**server, "vllm_config": {**server["vllm_config"], "speculative_config": {"method": "mtp"}}}
    assert layout_of(mtp, right.name).describe() == "vllm:tp=1,dtype=bfloat16,spec=mtp"
    # a draft laid out otherwise than its target: refused, naming the setting
    for own in ({"draft_tensor_parallel_size": 2}, {"quantization": "fp8"}, {"moe_backend": "cutlass"}):
        forged = {**server, "vllm_config": {**server["vllm_config"], "speculative_config": {"method": "mtp", **own}}}
        with pytest.raises(UnsupportedLayout, match=next(iter(own))):
            layout_of(forged, right.name)
