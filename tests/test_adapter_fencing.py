"""A late adapter sender lands nothing: the adapter's update obeys the session as the weights' does.

A sender process starts an adapter update and stops itself inside its first post (its fence check
passed: the write goes out when it resumes). Its short lease expires, the engine tears the session
and marks the adapter torn; another controller's adapter update takes it over (revoking the lost
owner's epoch: every rank moves its registrations) and commits. Resumed, the late post fails, and
every byte of the adapter's slot stays the second controller's. Real receiver processes with
sglang's LoRA pool, Mooncake over loopback."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from p2pweights.control import SglangEngine
from p2pweights.control import protocol as p
from p2pweights.receiver import start_engine
from p2pweights.replica.lora_reference import random_peft_adapter, write_peft_adapter
from p2pweights.sender import WeightSender
from p2pweights.sender.verify import _ask
from p2pweights.transport.peer import wait_stopped
from replica_configs import write_config
from test_adapter_update import SETTING, _assert_equals_sglangs_own_load

CHILD = textwrap.dedent('''
    import json, os, signal, sys, time
    from p2pweights.errors import P2PWeightsError
    from p2pweights.replica.lora_reference import random_peft_adapter
    from p2pweights.sender import WeightSender
    from p2pweights.transport import mooncake

    cfg, url, go = sys.argv[1:4]
    def say(**kw):
        print(json.dumps(kw), flush=True)
    real_post, posts = mooncake.MooncakeBackend.post, []
    def post(self, engine, local, remote, lengths):
        posts.append(engine)
        if len(posts) == 1:  # the adapter's one slot: its first post, stopped inside it
            say(event="writing")
            os.kill(os.getpid(), signal.SIGSTOP)
        return real_post(self, engine, local, remote, lengths)
    mooncake.MooncakeBackend.post = post
    sender = WeightSender(cfg, transport="mooncake")
    sender.connect([url])
    adapter_config, tensors = random_peft_adapter(cfg, r=4, seed=71)
    say(event="ready")
    try:
        with sender.update(1, adapter="a", adapter_config=adapter_config) as update:
            update.push_many(tensors)
        say(event="done")
    except P2PWeightsError as e:
        say(event="failed", error=str(e))
    sys.stdout.flush()
    os._exit(0)
''')


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return write_config("qwen3", str(tmp_path_factory.mktemp("fence_cfg")))


def _events(proc: subprocess.Popen) -> "queue.Queue":
    q: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:
            try:
                q.put(json.loads(line))
            except ValueError:
                continue
        q.put(None)
    threading.Thread(target=read, daemon=True).start()
    return q


def _slot_digests(client: SglangEngine, slot: int, ranks: int) -> dict:
    info = client.transfer_engine_info  # every published adapter slot entry of this slot, per rank
    names = {str(r): sorted(n for n in info(r)["remote_instance_transfer_engine_info"][1]
                            if n.startswith("lora.") and n.endswith(f"@{slot}")) for r in range(ranks)}
    return _ask(client, names)["ranks"]


def test_a_late_adapter_sender_lands_nothing_after_a_takeover(cfg, tmp_path):
    engine = start_engine(cfg, "tp=2", transport="mooncake", name="fenced", lora=SETTING, startup_timeout=300)
    client = SglangEngine(engine.url, name="fenced")
    proc = None
    try:
        loaded_config, loaded = random_peft_adapter(cfg, r=4, seed=70)
        slot = client.load_lora_adapter("a", write_peft_adapter(str(tmp_path / "a"), loaded_config, loaded))["p2pw_slot"]
        go = str(tmp_path / "go")
        proc = subprocess.Popen([sys.executable, "-c", CHILD, cfg, engine.url, go], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "P2PW_SESSION_LEASE": "2"})
        events = _events(proc)
        assert events.get(timeout=240)["event"] == "ready"
        assert events.get(timeout=240)["event"] == "writing"
        wait_stopped(proc.pid)
        deadline = time.monotonic() + 20
        while client.server_info()["p2pw_weight_update"]["state"] == "open" and time.monotonic() < deadline:
            time.sleep(0.2)
        state = client.server_info()["p2pw_weight_update"]
        assert state["state"] == p.TORN, state

        adapter_config, tensors = random_peft_adapter(cfg, r=4, seed=72)  # another controller takes it over
        with WeightSender(cfg, transport="mooncake") as sender:
            sender.connect([client])
            with sender.update(2, adapter="a", adapter_config=adapter_config, verify=True) as update:
                update.push_many(tensors)
        ours = _slot_digests(client, slot, 2)
        state = client.server_info()["p2pw_weight_update"]
        assert state["adapters"]["a"] == {"version": "2", "torn": None} and state["epoch"] >= 2, state

        proc.send_signal(signal.SIGCONT)  # its post goes out, to the revoked epoch's endpoint
        result = events.get(timeout=120)
        assert result["event"] == "failed", result
        proc.wait(30)
        time.sleep(1.0)  # anything still on the wire has landed by now
        assert _slot_digests(client, slot, 2) == ours  # not one byte of the late sender's
        assert client.server_info()["p2pw_weight_update"]["adapters"]["a"]["version"] == "2"
        # and what the engine holds is the second controller's adapter, as sglang's own load puts it
        _assert_equals_sglangs_own_load(engine, cfg, 2, slot, adapter_config, tensors, tmp_path)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        engine.close()
