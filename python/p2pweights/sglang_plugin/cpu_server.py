"""Real sglang 0.5.23 servers on a host without CUDA, started from outside: ``python -m
sglang.launch_server`` on the plugin's ``p2pw_cpu`` platform (``cpu_platform.py``), with dummy
weights and the plugin loaded as in any server. Used by ``p2pweights demo --engine-kind sglang`` and
by the tests (``tests/sglang_server.py``).

    server = CpuSglangServer.start(model_dir, log_path, tp=1, seed_via_mooncake=True)
    try:
        server.wait_healthy()
        ...
    finally:
        stop_servers([server])

``seed_via_mooncake``: sglang's own ``--remote-instance-weight-loader-start-seed-via-transfer-engine``
(each rank registers its weights with sglang's Mooncake transfer engine and publishes them at the
engine-info bootstrap server, which is what a p2pweights sender writes into), over TCP on 127.0.0.1
(sglang's defaults are RDMA and the host's outward address) and on a bootstrap port of its own (not
6789: other servers may run on this host). The plugin's hook registers the host-memory weights
(``weight_registration.py``); without the plugin such a CPU server dies while starting.

Each server runs in its own session (process group) and is stopped with it. A server that exits, or
is not healthy in time, raises :class:`ServerFailed` with the tail of its log.

This module runs on the side that starts servers, never inside one: the plugin's ``register`` does
not import it.
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
from typing import Any, Sequence, TypeVar

from ..control import routes
from ..control.protocol import SEED_FLAG
from ..errors import EngineError

# What runs sglang's own scheduler, model runner and HTTP server on a CPU host (docs/sglang.md).
CPU_SERVER_FLAGS = (
    "--device", "cpu",
    "--load-format", "dummy",
    "--skip-tokenizer-init",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    # sglang sizes the KV cache from host memory measured before and after its weights load; other
    # processes loading meanwhile (the other servers, the senders) made 0.1 fail ("Loaded weights leave
    # no GPU memory for the KV cache") with qwen3-0.6b; the cap below keeps the cache small anyway
    "--mem-fraction-static", "0.5",
    "--max-total-tokens", "2048",  # a KV cache of 2048 tokens instead of a fraction of RAM: 10 s less start-up
    "--disable-radix-cache",
    # an idle CPU scheduler polls its sockets without pause: a tp=2 server's two ranks took 1.4 of this
    # host's 2 cores doing nothing; with it, 0.06
    "--sleep-on-idle",
)  # CUDA graphs are off by themselves with torch_native attention
PLATFORM = "p2pw_cpu"  # cpu_platform.NAME (not imported: it imports torch and sglang's platforms)
# what keeps sglang's Mooncake publication (SEED_FLAG) on loopback TCP
MOONCAKE_LOOPBACK_ENV = {"MOONCAKE_PROTOCOL": "tcp", "SGLANG_HOST_IP": "127.0.0.1"}
HEALTH_TIMEOUT_S = 300.0  # a shared 2-core host under load needs more than 2 minutes

_Server = TypeVar("_Server", bound="CpuSglangServer")


class ServerFailed(EngineError):
    """A CPU sglang server exited, or was not healthy in time; the message ends with its log's tail."""


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


def omp_binding(tp: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND`` for ``tp`` ranks: one core each (``0|1``), wrapping round the
    host's cores. sglang's CPU ranks need it for tp > 1."""
    return "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))


class CpuSglangServer:
    """One server's launcher process (its process group) and its HTTP address."""

    def __init__(self, proc: subprocess.Popen, url: str, log_path: str, started: float, name: str = ""):
        self.proc = proc
        self.url = url
        self.log_path = log_path
        self.started = started
        self.name = name or url
        self.healthy_after_s: float | None = None

    @classmethod
    def start(cls: type[_Server], model_dir: str, log_path: str, *, tp: int = 1, env: dict[str, str] | None = None,
              extra_args: Sequence[str] = (), seed_via_mooncake: bool = False, name: str = "") -> _Server:
        """Start (not wait for) a server on ``model_dir`` (a folder with config.json), its output in
        ``log_path``; ``env`` is added to this process's environment, ``extra_args`` to the command."""
        port = free_port()
        full_env = {**os.environ, "SGLANG_PLATFORM": PLATFORM, **(MOONCAKE_LOOPBACK_ENV if seed_via_mooncake else {}),
                    **(env or {})}
        if tp > 1:
            full_env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", omp_binding(tp))
        seed = (SEED_FLAG, "--engine-info-bootstrap-port", str(free_port())) if seed_via_mooncake else ()
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_dir, "--host", "127.0.0.1",
               "--port", str(port), "--tp-size", str(tp), *CPU_SERVER_FLAGS, *seed, *extra_args]
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=full_env, start_new_session=True)
        return cls(proc, f"http://127.0.0.1:{port}", log_path, time.monotonic(), name)

    def get_json(self, path: str, timeout: float = 30.0) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return json.loads(r.read())

    def fail(self, why: str) -> None:
        raise ServerFailed(f"sglang server {self.name} ({self.url}): {why}\n--- last lines of {self.log_path} ---\n"
                           f"{log_tail(self.log_path)}")

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> None:
        """Until ``/health`` answers 200 (after sglang's warm-up generate), ``timeout`` seconds from
        the start; :meth:`fail` when the server exits first or the time is up."""
        deadline = self.started + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                self.fail(f"exited with code {code} before it was healthy")
            try:
                with urllib.request.urlopen(self.url + routes.route("health").path, timeout=5) as r:
                    if r.status == 200:
                        self.healthy_after_s = time.monotonic() - self.started
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                self.fail(f"not healthy after {timeout:.0f} s")
            time.sleep(0.5)

    def terminate(self) -> None:
        """SIGTERM to the launcher: it drains and ends the processes it started."""
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


def stop_servers(servers: Sequence[CpuSglangServer]) -> None:
    for server in servers:
        server.terminate()  # all at once: their shutdowns overlap
    for server in servers:
        server.stop()
