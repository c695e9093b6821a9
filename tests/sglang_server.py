"""A real sglang 0.5.23 server for tests: ``python -m sglang.launch_server`` with a tiny config and
dummy weights, on the CPU through p2pweights' CPU platform (``SGLANG_PLATFORM=p2pw_cpu``). The
launcher is the package's own (``p2pweights.sglang_plugin.cpu_server``, which the demo's
``--engine-kind sglang`` uses too); here a server that fails fails the test.

    with sglang_server(model_dir, log_path, tp=1, env={...}) as server:
        server.get_json("/server_info")

    servers = [start_sglang_server(...), start_sglang_server(...)]   # start-ups overlap
    try: [s.wait_healthy() for s in servers] ... finally: stop(servers)

Each server runs in its own session (process group) and is stopped with it. A server that exits or
is not healthy in time fails the test with the tail of its log: a missing package shows as the
ImportError it raised, never as a skip.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import pytest

from p2pweights.sglang_plugin.cpu_server import (  # noqa: F401 (re-exported for the tests)
    CPU_SERVER_FLAGS,
    HEALTH_TIMEOUT_S,
    CpuSglangServer,
    free_port,
    log_tail,
    stop_servers,
)


class SglangServer(CpuSglangServer):
    def fail(self, why: str) -> None:
        pytest.fail(f"sglang server {self.url}: {why}\n--- last lines of {self.log_path} ---\n{log_tail(self.log_path)}",
                    pytrace=False)


def start_sglang_server(model_dir: str, log_path: str, *, tp: int = 1, env: dict[str, str] | None = None,
                        extra_args: tuple[str, ...] = (), seed_via_mooncake: bool = False) -> SglangServer:
    """Start (not wait for) a real sglang server on ``model_dir`` (a folder with config.json);
    ``env`` is added to this process's environment. ``seed_via_mooncake``: the ranks publish their
    weights over Mooncake (TCP on loopback, a bootstrap port of its own; ``cpu_server.py``)."""
    return SglangServer.start(model_dir, log_path, tp=tp, env=env, extra_args=extra_args,
                              seed_via_mooncake=seed_via_mooncake)


def stop(servers: list[SglangServer]) -> None:
    stop_servers(servers)


@contextlib.contextmanager
def sglang_server(model_dir: str, log_path: str, **kwargs: Any) -> Iterator[SglangServer]:
    """One server: started, healthy, yielded, stopped."""
    server = start_sglang_server(model_dir, log_path, **kwargs)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()
