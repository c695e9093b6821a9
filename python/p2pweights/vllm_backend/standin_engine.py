"""One stand-in vLLM 0.33 engine on this host, for the tests and ``p2pweights demo --engine-kind vllm``
(docs/vllm.md, "How it was tested"): ``dp`` x ``tp`` worker processes (``cpu_worker.py``: vLLM's
``CpuPlatform``, config, model classes, loaders that shard for the rank, post-processing, the
``p2pweights`` backend made by vLLM's factory; with ``spec="mtp"`` vLLM's MTP drafter too), each DP
rank's ``tp`` workers in one gloo group (a dense model's DP ranks are independent engines in vLLM),
behind vLLM's own RL and dev routers with ``--api-key`` and the gate from ``--middleware``
(``standin_api.py``, whose client fans every RPC out to all workers, answering in vLLM's rank
order), served by uvicorn on 127.0.0.1 in this process; ``/init_weight_transfer_engine`` registers
every worker's memory over Mooncake (each rank its own publication). With ``hopper`` (a vLLM
layout spec, ``"tp=2,ep=2"``) every worker holds what a Hopper engine rank of that layout holds
(``cpu_worker --hopper``: the replica's Hopper stand-in, FP8 MoE included) and the API server serves
that engine's config. With ``lora`` (a
``VllmLoRASetting``) every worker runs vLLM's LoRA and the API server vLLM's LoRA routes
(``/v1/load_lora_adapter``); each worker registers and publishes its LoRA slots with its weights.
Runs where vLLM imports (``.vllm_site``, docs/vllm.md).

    engine = StandInVllmEngine(config_dir, log_path, "engine0", tp=2)
    try:
        engine.wait_ready()       # engine.url, engine.api_key, engine.client, engine.app
        ...
    finally:
        engine.close()
"""
from __future__ import annotations

import dataclasses
import json
import secrets
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from ..errors import EngineError
from . import cpu_worker
from .standin_api import StandInEngineClient, api_app

TRANSPORT = "mooncake"  # what the worker registers its memory with
GATE = "p2pweights.vllm_backend.gate.SessionGate"
START_TIMEOUT_S = 900.0  # each worker imports vLLM and builds its model: minutes on a loaded 2-core host
INIT_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def json_line(proc: subprocess.Popen, timeout: float, what: str) -> Any:
    """The next JSON line ``proc`` prints, read on a thread so a hung child fails within ``timeout``."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not box:
        raise EngineError(f"{what} gave no answer within {timeout:.0f} s (exit {proc.poll()})")
    if not box[0]:  # its stdout closed: it is exiting (its log says why)
        try:
            code = proc.wait(10)
        except subprocess.TimeoutExpired:
            code = None
        raise EngineError(f"{what} closed its output before answering (exit {code}; its log says why)")
    return json.loads(box[0])


def stop_process(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(30)
    except (subprocess.TimeoutExpired, OSError):
        proc.kill()
        proc.wait(10)


class StandInVllmEngine:
    """One stand-in vLLM engine (module docstring): ``url``, ``name``, ``api_key``; ``client_kind``
    tells the demo's senders to drive it with a ``VllmEngine``."""

    client_kind = "vllm"  # the demo's senders drive it with a control.VllmEngine

    def __init__(self, model_dir: str, log_path: str, name: str, tp: int = 1, spec: str = "", dp: int = 1,
                 lora: Any = None, hopper: str = ""):
        self.hopper = cpu_worker.hopper_layout(hopper) if hopper else None  # a Hopper engine of this layout
        if self.hopper is not None:
            if spec or lora is not None or dp != 1:
                raise ValueError(f"stand-in vLLM engine {name}: a Hopper engine runs one DP rank, no draft, no LoRA")
            tp = self.hopper.tp
        for what, n in (("tp", tp), ("dp", dp)):
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"stand-in vLLM engine {name}: {what} must be an integer >= 1, got {n!r}")
        if spec not in cpu_worker.SPECS:
            raise ValueError(f"stand-in vLLM engine {name}: spec must be one of {cpu_worker.SPECS}, got {spec!r}")
        self.model_dir, self.name, self.tp, self.spec, self.dp = model_dir, name, tp, spec, dp
        self.lora = lora  # a VllmLoRASetting: vLLM's LoRA on every worker and its LoRA routes (None: off)
        lora_args = ["--lora", json.dumps(dataclasses.asdict(lora))] if lora is not None else []
        hopper_args = ["--hopper", hopper] if hopper else []
        self.api_key = secrets.token_urlsafe(24)
        self._authkey = secrets.token_bytes(16)
        self._log = open(log_path, "ab")
        self.url = ""
        self.client = self.app = self._server = None
        self._workers: list[subprocess.Popen] = []
        for dp_rank in range(dp):  # in vLLM's rank order: DP rank x tp + TP rank
            dist_port = free_port()  # a DP rank's gloo rendezvous: its tp workers join it (dense DP ranks are apart)
            for rank in range(tp):
                worker = subprocess.Popen(
                    [sys.executable, "-m", "p2pweights.vllm_backend.cpu_worker", "--model", model_dir, "--seed", "1",
                     "--dist-port", str(dist_port), "--tp", str(tp), "--rank", str(rank), "--spec", spec,
                     "--dp", str(dp), "--dp-rank", str(dp_rank), *lora_args, *hopper_args],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True)
                self._workers.append(worker)
                worker.stdin.write(self._authkey.hex() + "\n")
                worker.stdin.flush()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Every worker's model built; vLLM's routes served; every worker's memory registered (Mooncake)."""
        import requests
        import uvicorn

        deadline = time.monotonic() + timeout
        addresses = []
        for rank, worker in enumerate(self._workers):  # built together: the later ones are ready about as soon
            ready = json_line(worker, max(1.0, deadline - time.monotonic()), f"vLLM worker rank {rank} of {self.name}")
            if ready.get("rank") != rank % self.tp:
                raise EngineError(f"{self.name}: worker rank {rank} says it is TP rank {ready.get('rank')}")
            addresses.append(tuple(ready["address"]))
        if self.hopper is not None:  # the Hopper engine's config, as the replica builds it
            vllm_config = cpu_worker.hopper_engine_config(self.model_dir, self.hopper)
        else:
            vllm_config = cpu_worker.engine_config(self.model_dir, self.tp, self.spec, self.dp,  # vLLM's API server's
                                                   lora=self.lora)
        self.client = StandInEngineClient(addresses, self._authkey)
        self.client.vllm_config = vllm_config  # vLLM's /server_info and /get_world_size read it
        self.app = app = api_app(["--middleware", GATE, f"--api-key={self.api_key}"],  # one token: a key may start with "-"
                                 self.client, lora=self.lora is not None)
        app.state.vllm_config = vllm_config
        port = free_port()
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                     lifespan="off"))
        threading.Thread(target=self._server.run, name=f"p2pw-{self.name}-api", daemon=True).start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if time.monotonic() > deadline:
                raise EngineError(f"{self.name}: vLLM's API app did not start serving on port {port}")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port}"
        # vLLM's init route, once (no verb of the session: a vLLM deployment runs it when it starts)
        r = requests.post(self.url + "/init_weight_transfer_engine", json={"init_info": {"transport": TRANSPORT}},
                          headers={"Authorization": f"Bearer {self.api_key}"}, timeout=INIT_TIMEOUT_S)
        if r.status_code != 200:
            raise EngineError(f"{self.name}: /init_weight_transfer_engine answered {r.status_code}: {r.text[:300]}")

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self.client is not None:
            self.client.close()  # the workers' loops end with it
        for worker in self._workers:
            stop_process(worker)
        self._workers = []
        self._log.close()
