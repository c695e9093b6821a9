"""A real sglang 0.5.23 server for tests: ``python -m sglang.launch_server`` with a tiny config and
dummy weights, on the CPU through p2pweights' CPU platform (``SGLANG_PLATFORM=p2pw_cpu``).

    with sglang_server(model_dir, log_path, tp=1, env={...}) as server:
        server.get_json("/server_info")

    servers = [start_sglang_server(...), start_sglang_server(...)]   # start-ups overlap
    try: wait_healthy(servers) ... finally: stop(servers)

Each server runs in its own session (process group) and is stopped with it. A server that exits or
is not healthy in time fails the test with the tail of its log: a missing package shows as the
ImportError it raised, never as a skip.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import Any, Iterator

import pytest

# What runs sglang's own scheduler, model runner and HTTP server on a CPU host (docs/sglang.md).
CPU_SERVER_FLAGS = (
    "--device", "cpu",
    "--load-format", "dummy",
    "--skip-tokenizer-init",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--mem-fraction-static", "0.1",
    "--max-total-tokens", "2048",  # a KV cache of 2048 tokens instead of 0.1 of RAM: 10 s less start-up
    "--disable-radix-cache",
)  # CUDA graphs are off by themselves with torch_native attention
HEALTH_TIMEOUT_S = 300.0  # a shared 2-core host under load needs more than 2 minutes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: str, lines: int = 60) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


class SglangServer:
    def __init__(self, proc: subprocess.Popen, url: str, log_path: str, started: float):
        self.proc = proc
        self.url = url
        self.log_path = log_path
        self.started = started
        self.healthy_after_s: float | None = None

    def get_json(self, path: str, timeout: float = 30.0) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def fail(self, why: str) -> None:
        pytest.fail(f"sglang server {self.url}: {why}\n--- last lines of {self.log_path} ---\n{log_tail(self.log_path)}",
                    pytrace=False)

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        deadline = self.started + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                self.fail(f"exited with code {code} before it was healthy")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        self.healthy_after_s = time.monotonic() - self.started
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                self.fail(f"not healthy after {timeout:.0f} s")
            time.sleep(0.5)

    def terminate(self) -> None:
        """SIGTERM to the launcher: it drains (nothing, here) and ends the processes it started."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()

    def stop(self, timeout: float = 15.0) -> None:
        """:meth:`terminate`, then SIGKILL to whatever is left of the process group after ``timeout``."""
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything that outlived the launcher
        self.proc.wait()


def start_sglang_server(model_dir: str, log_path: str, *, tp: int = 1, env: dict[str, str] | None = None,
                        extra_args: tuple[str, ...] = ()) -> SglangServer:
    """Start (not wait for) a real sglang server on ``model_dir`` (a folder with config.json);
    ``env`` is added to this process's environment."""
    port = free_port()
    full_env = {**os.environ, "SGLANG_PLATFORM": "p2pw_cpu", **(env or {})}
    if tp > 1:
        full_env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", "127.0.0.1",
           "--port", str(port), "--tp-size", str(tp), *CPU_SERVER_FLAGS, *extra_args]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=full_env, start_new_session=True)
    return SglangServer(proc, f"http://127.0.0.1:{port}", log_path, time.monotonic())


def stop(servers: list[SglangServer]) -> None:
    for server in servers:
        server.terminate()  # all at once: their shutdowns overlap
    for server in servers:
        server.stop()


@contextlib.contextmanager
def sglang_server(model_dir: str, log_path: str, **kwargs: Any) -> Iterator[SglangServer]:
    """One server: started, healthy, yielded, stopped."""
    server = start_sglang_server(model_dir, log_path, **kwargs)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()
