"""`p2pweights serve`: one receiver engine in the foreground, as a trainer author runs it.

Started as a subprocess (real rank processes, real Mooncake on 127.0.0.1): ready when /health
answers 200 (its one ready line names the URL), updated by a WeightSender with the key, equal to
sglang's own loader; SIGTERM stops it with exit code 0 and leaves no rank process behind. Bad
flags are refused before any rank starts.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from p2pweights.control import SglangEngine, routes
from p2pweights.control import protocol as p
from p2pweights.control.http import request
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
from p2pweights.receiver import check_weights_equal
from p2pweights.sender import WeightSender
from replica_configs import write_config

KEY = "serve-test-key"


def _serve(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "p2pweights", "serve", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})


def _wait_ready(proc: subprocess.Popen, timeout: float = 240.0) -> str:
    """The URL of the ready line (stdout); fails with the command's stderr if it exits first."""
    found: list[str] = []

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            m = re.search(r"\bready (http://\S+)", line)
            if m:
                found.append(m.group(1))
                return
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not found:
        proc.kill()
        raise AssertionError(f"serve was not ready in {timeout}s (code {proc.poll()}):\n{proc.stderr.read()[-3000:]}")
    return found[0]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_serve_runs_an_engine_a_sender_updates_and_sigterm_stops_every_rank(tmp_path):
    cfg = write_config("qwen3", str(tmp_path))
    proc = _serve("--model", cfg, "--engine", "tp=2", "--port", "0", "--transport", "mooncake",
                  "--name", "served", env={"P2PW_API_KEY": KEY})
    try:
        url = _wait_ready(proc)
        assert request("GET", url, routes.route("health").path)[0] == p.OK
        assert request("GET", url, routes.route("server_info").path)[0] == p.UNAUTHORIZED
        info = SglangEngine(url, api_key=KEY).server_info()
        assert info["tp_size"] == 2 and info["p2pw_engine_name"] == "served"
        ranks = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
        assert len(ranks) >= 3, ranks  # the launcher and two rank processes

        with WeightSender(cfg, transport="mooncake", buffer_size=1 << 20, api_key=KEY) as sender:
            sender.connect([url])
            with sender.update("v7") as update:
                for name, t in random_checkpoint(checkpoint_tensors(cfg), 7):
                    update.push(name, t)
        result = check_weights_equal(url, hf_seed=7, api_key=KEY)
        assert result["success"], result["message"]
        assert SglangEngine(url, api_key=KEY).weight_version() == "v7"

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()[-3000:]
        deadline = time.monotonic() + 10
        while not all(_gone(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_gone(pid) for pid in ranks), [pid for pid in ranks if not _gone(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("args, says", [
    (["--engine", "tp=2,chunked_prefill_size=4096"], "serve cannot honour"),
    (["--model", "no-such-model"], "--model"),
])
def test_serve_refuses_bad_flags_before_starting_anything(tmp_path, args, says):
    cfg = write_config("qwen3", str(tmp_path))
    proc = _serve("--model", cfg, "--port", "0", *args)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, (out, err)
    assert says in err and "ready" not in out, err


def test_serve_enable_lora_loads_an_adapter_by_sglangs_route_and_a_sender_updates_it(tmp_path):
    from p2pweights.replica.lora_reference import random_peft_adapter, write_peft_adapter

    cfg = write_config("qwen3", str(tmp_path))
    proc = _serve("--model", cfg, "--engine", "tp=2", "--port", "0", "--transport", "mooncake", "--enable-lora",
                  "--max-lora-rank", "8", "--max-loras-per-batch", "3")
    try:
        url = _wait_ready(proc)
        client = SglangEngine(url, name="served")
        info = client.server_info()
        assert info["enable_lora"] is True and info["max_lora_rank"] == 8 and info["max_loras_per_batch"] == 3
        adapter_config, tensors = random_peft_adapter(cfg, r=4, seed=3)
        assert client.load_lora_adapter("a", write_peft_adapter(str(tmp_path / "a"), adapter_config, tensors))["p2pw_slot"] == 1
        with WeightSender(cfg, transport="mooncake") as sender:
            sender.connect([client])
            with sender.update(1, adapter="a", adapter_config=adapter_config, verify=True) as update:
                update.push_many(tensors)
        assert update.report.bytes_written == update.report.bytes > 0
        assert client.server_info()["p2pw_weight_update"]["adapters"]["a"]["version"] == "1"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, proc.stderr.read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
