"""The vLLM backend ``p2pweights`` (python/p2pweights/vllm_backend, docs/vllm.md), as real as this
CPU host allows: vLLM 0.33's own ``WeightTransferEngineFactory`` makes the backend for a model built
by vLLM's own Qwen3 classes (``CpuPlatform``) inside a worker process (``vllm_backend.cpu_worker``:
vLLM's ``CPUWorker`` methods through vLLM's ``run_method``); vLLM's own RL and dev routes, exception
handlers and middleware registration load the gate from ``--middleware`` in this process's API
server (uvicorn, real HTTP on 127.0.0.1); a separate sender process writes over real Mooncake into
the memory the worker registered, found through the key-guarded publication. Byte-exactness is
judged by vLLM's own ``/weight_checker`` checksums (SHA-256 of every parameter) against a fresh
vLLM load of the same checkpoint in the sender process.

What is not vLLM's: the worker object is made without ``Worker.__init__`` and the RPCs cross a
``multiprocessing`` connection instead of vLLM's engine core; the API server's ``AsyncLLM`` is a
stand-in that runs ``AsyncLLM``'s own weight-transfer methods (``vllm_backend.standin_api``)."""
from __future__ import annotations

import importlib.util
import json
import os
import secrets
import select
import socket
import subprocess
import sys
import time
import types

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")  # vLLM's CpuPlatform (the CUDA one cannot import here)
os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")  # vLLM mounts its RL routes only then

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not importable (scripts/setup.sh installs vLLM 0.33.0 into .vllm_site: run with "
                "PYTHONPATH=.vllm_site, docs/vllm.md)", allow_module_level=True)

requests = pytest.importorskip("requests")

from p2pweights.control import protocol as p  # noqa: E402
from p2pweights.transport.publication import EnginePublication  # noqa: E402
from replica_configs import write_config  # noqa: E402

STARTUP = 900.0  # seconds: three processes import vLLM (20-120 s each on the 2-core machine)

SENDER = r'''
import json, os, sys, time
out = os.fdopen(os.dup(1), "w")  # the result lines own stdout; what vLLM and Mooncake print goes to stderr
os.dup2(2, 1)
sys.stdout = sys.stderr
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import numpy as np, torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests
from p2pweights.control.weights_digest import digest
from p2pweights.transport import make_backend
from p2pweights.transport.publication import EnginePublication
from p2pweights.vllm_backend import cpu_worker
cfg, seed, dist_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
vc = cpu_worker.engine_config(cfg)
model = cpu_worker.build_model(vc, cfg, seed, dist_port, post_process=False)
raw = {n: t.detach().clone() for n, t in model.named_parameters()}  # the bytes before post-processing
with set_current_vllm_config(vc):
    process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
reference = compute_tensor_digests(model)  # a fresh vLLM load of checkpoint `seed`, as /weight_checker hashes it
print(json.dumps({"event": "built"}), file=out, flush=True)
pub = EnginePublication.from_json(json.loads(sys.stdin.readline()))
pub.check_regions("vllm")
assert set(pub.params) == set(raw), sorted(set(pub.params) ^ set(raw))
names = sorted(raw)
parts = [raw[n].contiguous().view(-1).view(torch.uint8).numpy() for n in names]
blob = np.concatenate(parts)
be = make_backend(pub.transport)
be.register_memory(blob.ctypes.data, blob.nbytes, "cpu")
be.connect(0, pub.descriptor)
srcs, dsts, lens, at = [], [], [], 0
for n, part in zip(names, parts):
    target = pub.target(n, part.nbytes, "vllm")
    srcs.append(blob.ctypes.data + at); dsts.append(target.data_ptr); lens.append(part.nbytes)
    at += part.nbytes
req = be.post(0, srcs, dsts, lens)
while be.poll(req) == 1:
    time.sleep(0.001)
print(json.dumps({"status": be.poll(req), "bytes": int(blob.nbytes), "reference": reference,
                  "digests": {n: digest(raw[n]) for n in names}}), file=out, flush=True)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_json_line(proc: subprocess.Popen, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 1.0)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            return json.loads(line)
        if proc.poll() is not None:
            break
    raise AssertionError(f"process {proc.args[:4]} gave no ready line (exit {proc.poll()})")


def end_child(proc: subprocess.Popen) -> None:
    """A child that reads commands from stdin: close its stdin (its cue to exit), kill it if it hangs."""
    if proc.poll() is None:
        proc.stdin.close()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


class Engine(types.SimpleNamespace):
    """The API server's URL and key; ``call`` sends one request as a controller (owner token or none)."""

    def call(self, method: str, path: str, body: dict | None = None, *, owner: str | None = None,
             key: str | None = "default", lease: float | None = None, params: dict | None = None):
        headers = {}
        if key == "default":
            key = self.key
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        if owner is not None:
            headers[p.SESSION_OWNER_HEADER] = owner
        if lease is not None:
            headers[p.SESSION_LEASE_HEADER] = str(lease)
        r = requests.request(method, self.url + path, json=body, headers=headers, params=params, timeout=300)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    def checksums(self) -> dict[str, str]:
        status, answer = self.call("POST", "/weight_checker", {"action": "checksum"})
        assert status == 200, answer
        return {k.split(":", 4)[-1]: v for k, v in answer["checksums"].items()}  # "dp0:pp0:pcp0:tp0:<name>"

    def publication(self) -> EnginePublication:
        status, answer = self.call("GET", "/remote_instance_transfer_engine_info", params={"rank": 0})
        assert status == 200, answer
        return EnginePublication.from_json(answer)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from p2pweights.vllm_backend.standin_engine import StandInVllmEngine

    root = tmp_path_factory.mktemp("vllm_cfg")
    cfg = write_config("qwen3", str(root))
    standin = StandInVllmEngine(cfg, str(root / "engine.log"), "vllm-backend")
    try:
        standin.wait_ready(STARTUP)  # the worker's memory registered over Mooncake (/init_weight_transfer_engine)
        yield Engine(url=standin.url, key=standin.api_key, client=standin.client, cfg=cfg, app=standin.app)
    finally:
        standin.close()


def send_checkpoint(engine: Engine, seed: int) -> dict:
    """A sender process: a fresh vLLM load of checkpoint ``seed`` (its reference digests), its bytes
    written over Mooncake into the published memory."""
    sender = subprocess.Popen([sys.executable, "-c", SENDER, engine.cfg, str(seed), str(free_port())],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert read_json_line(sender, STARTUP)["event"] == "built"
        sender.stdin.write(json.dumps(engine.publication().to_dict()) + "\n")
        sender.stdin.flush()
        return read_json_line(sender, 300)
    finally:
        if sender.poll() is None:
            sender.kill()
        sender.wait(30)


def owner() -> str:
    return secrets.token_urlsafe(32)


def test_vllm_loads_the_gate_from_its_middleware_option_and_the_backend_from_its_factory(engine):
    from p2pweights.vllm_backend.gate import SessionGate

    assert any(m.cls is SessionGate for m in engine.app.user_middleware)
    status, answer = engine.call("GET", "/p2pw_weight_update")
    assert status == 200 and answer["state"] == "none" and answer["epoch"] == 1
    # the backend vLLM's factory made answers its verbs in the worker (through collective_rpc)
    assert "weight_transfer_engine:publication" in engine.client.calls or engine.publication().epoch == 1
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml")) as f:
        assert 'p2pweights = "p2pweights.vllm_backend:register"' in f.read()
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    from p2pweights.vllm_backend import register

    register()
    register()  # vLLM loads plugins several times per process: the second is a no-op, not a ValueError
    assert "p2pweights" in WeightTransferEngineFactory._registry


def test_the_publication_and_every_weight_route_need_the_key(engine):
    for key in (None, "wrong-" + engine.key):
        for method, path, body in [("GET", "/remote_instance_transfer_engine_info", None),
                                   ("POST", "/init_weight_transfer_engine", {"init_info": {}}),
                                   ("POST", "/start_weight_update", None), ("POST", "/pause", None),
                                   ("POST", "/weight_checker", {"action": "reset"}),
                                   ("POST", "/collective_rpc", {"method": "reset_weights"}),
                                   ("POST", "/p2pw_weights_digest", {"names": {}})]:
            status, answer = engine.call(method, path, body, key=key, params={"rank": 0})
            assert status == p.UNAUTHORIZED, (path, key, answer)
    pub = engine.publication()
    assert pub.transport == "mooncake" and pub.epoch == 1 and pub.delta_area and pub.rank == 0
    pub.check_regions("vllm")
    assert "model.layers.0.self_attn.qkv_proj.weight" in pub.params  # vLLM's own parameter names
    # the gate's channel into the workers is not reachable through vLLM's own /collective_rpc
    status, answer = engine.call("POST", "/collective_rpc", {"method": "weight_transfer_engine",
                                                             "args": ["revoke", {"epoch": 9}]})
    assert status == p.BAD_REQUEST and engine.publication().epoch == 1, answer
    assert engine.call("POST", "/sleep")[0] == p.BAD_REQUEST  # it would free the registered memory


def test_a_one_sided_update_over_mooncake_equals_a_fresh_vllm_load(engine):
    me = owner()
    before = engine.checksums()
    assert engine.call("POST", "/pause", owner=me)[0] == 200
    status, begun = engine.call("POST", "/start_weight_update", owner=me)
    assert status == 200 and begun["lease"] > 0 and begun["epoch"] == 1, begun
    sent = send_checkpoint(engine, seed=2)
    assert sent["status"] == 0, sent
    # verify=True's digests: what the worker holds is what the sender wrote
    names = sorted(sent["digests"])
    status, digests = engine.call("POST", "/p2pw_weights_digest", {"names": {"0": names}}, owner=me)
    assert status == 200 and digests["ranks"]["0"] == sent["digests"], digests
    status, ended = engine.call("POST", "/finish_weight_update", {"weight_version": "v2"}, owner=me)
    assert status == 200 and ended["p2pw_base"]["epoch"] == 1, ended
    assert engine.call("POST", "/resume", owner=me)[0] == 200
    after = engine.checksums()
    assert after == sent["reference"], sorted(n for n in after if after[n] != sent["reference"].get(n))
    assert after != before  # the update changed the weights (checkpoint 1 -> 2): the check can fail
    assert engine.call("GET", "/weight_info")[1]["weight_version"] == "v2"


def test_another_controller_is_refused_409_while_the_owner_session_is_live(engine):
    me, other = owner(), owner()
    assert engine.call("POST", "/pause", owner=me)[0] == 200
    assert engine.call("POST", "/start_weight_update", owner=me)[0] == 200
    calls_before = list(engine.client.calls)
    for who in (other, None):  # another controller, and the anonymous one
        for method, path, body in [("POST", "/start_weight_update", None), ("POST", "/finish_weight_update", {}),
                                   ("POST", "/update_weights", {"update_info": {}}), ("POST", "/resume", None),
                                   ("POST", "/update_weight_version", {"new_version": "x"}),
                                   ("POST", "/weight_checker", {"action": "reset"})]:
            status, answer = engine.call(method, path, body, owner=who)
            assert status == p.CONFLICT and answer["error"]["type"] == "SessionConflict", (path, answer)
    assert engine.client.calls == calls_before  # nothing reached the workers
    assert engine.call("POST", "/finish_weight_update", {}, owner=me)[0] == 200
    assert engine.call("POST", "/resume", owner=me)[0] == 200


def test_a_dead_owner_leaves_the_engine_torn_until_a_complete_update(engine):
    dead, heir = owner(), owner()
    before = engine.publication()
    assert engine.call("POST", "/pause", owner=dead)[0] == 200
    assert engine.call("POST", "/start_weight_update", owner=dead, lease=1)[0] == 200
    time.sleep(1.5)  # the owner stops renewing: its lease lapses
    for path, body in [("/resume", None), ("/update_weight_version", {"new_version": "x"}),
                       ("/finish_weight_update", {}), ("/update_weights", {"update_info": {}})]:
        status, answer = engine.call("POST", path, body, owner=heir)
        assert status == p.CONFLICT and answer["error"]["type"] == "TornWeights", (path, answer)
    assert engine.call("POST", "/finish_weight_update", {}, owner=dead)[0] == p.CONFLICT
    status, begun = engine.call("POST", "/start_weight_update", owner=heir)
    assert status == 200 and begun["took_over"] and begun["epoch"] == before.epoch + 1, begun
    revoked = engine.publication()
    assert revoked.epoch == before.epoch + 1 and revoked.peer != before.peer  # the old endpoint is closed
    assert {n: t.data_ptr for n, t in revoked.params.items()} == {n: t.data_ptr for n, t in before.params.items()}
    status, ended = engine.call("POST", "/finish_weight_update", {}, owner=heir)
    assert status == 200, ended
    assert engine.call("POST", "/resume", owner=heir)[0] == 200
    assert engine.call("GET", "/p2pw_weight_update")[1]["state"] == "none"


def test_a_forged_delta_manifest_is_refused_with_nothing_applied(engine):
    me, heir = owner(), owner()
    assert engine.call("POST", "/pause", owner=me)[0] == 200
    assert engine.call("POST", "/start_weight_update", owner=me)[0] == 200
    status, ended = engine.call("POST", "/finish_weight_update", {}, owner=me)
    assert status == 200
    base = ended["p2pw_base"]
    held = engine.checksums()
    status, begun = engine.call("POST", "/start_weight_update", {"p2pw_delta": base}, owner=me)
    assert status == 200 and begun["p2pw_delta"]["accepted"], begun
    forged = {"0": {"bytes": 4096, "records": 1, "sha256": "ab" * 32}}  # nothing the owner wrote
    status, answer = engine.call("POST", "/finish_weight_update", {"p2pw_delta": forged}, owner=me)
    assert status == p.ENGINE_FAILED and answer["error"]["type"] == "InvalidWrite", answer
    assert engine.checksums() == held  # nothing applied
    status, answer = engine.call("POST", "/resume", owner=me)
    assert status == p.CONFLICT and answer["error"]["type"] == "TornWeights", answer
    # the base is forgotten: the next claim is refused (the sender writes in full)
    status, begun = engine.call("POST", "/start_weight_update", {"p2pw_delta": base}, owner=heir)
    assert status == 200 and begun["took_over"] and not begun["p2pw_delta"]["accepted"], begun
    # an update_info with a field the backend does not know is refused by vLLM's parse, and tears
    status, answer = engine.call("POST", "/update_weights", {"update_info": {"names": ["x"]}}, owner=heir)
    assert status >= 400, answer
    status, begun = engine.call("POST", "/start_weight_update", owner=me)
    assert status == 200 and begun["took_over"], begun
    assert engine.call("POST", "/finish_weight_update", {}, owner=me)[0] == 200
    assert engine.call("POST", "/resume", owner=me)[0] == 200
