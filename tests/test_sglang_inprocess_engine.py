"""An in-process ``sglang.Engine`` (how several RL frameworks run sglang) is refused, never served with
fewer guarantees in silence (docs/sglang.md, "An in-process sglang.Engine"; ``sglang_plugin/inprocess.py``).

A REAL ``sglang.Engine(model_path=..., ...)`` runs in a process of its own, on the CPU through the
plugin's ``p2pw_cpu`` platform: a tiny Qwen3, the test servers' flags as Engine keywords, and sglang's
seed flag, so its rank registers its weights with Mooncake and publishes them at the engine-info
bootstrap server. That process also serves a small HTTP front of its own, as an RL framework would:
``/server_info`` is the engine's own ``get_server_info()``. A real ``WeightSender`` connects to that
front, reading the rank's publication at the bootstrap server.

Beside it, a real ``python -m sglang.launch_server`` with the same flags: its publication carries no
refusal (the plugin refuses the in-process engine only).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import pytest

from conftest import require_sglang
from replica_configs import write_config
from sglang_server import CPU_SERVER_FLAGS, free_port, log_tail, start_sglang_server, stop

require_sglang()  # skips without sglang; fails in CI

from p2pweights.control import SglangEngine  # noqa: E402
from p2pweights.control.protocol import SEED_FLAG  # noqa: E402
from p2pweights.errors import UnsupportedLayout  # noqa: E402
from p2pweights.sender import WeightSender  # noqa: E402
from p2pweights.sglang_plugin import inprocess  # noqa: E402
from p2pweights.sglang_plugin.cpu_server import MOONCAKE_LOOPBACK_ENV, PLATFORM  # noqa: E402
from p2pweights.transport.publication import REFUSED_KEY, EnginePublication  # noqa: E402

STARTUP_TIMEOUT_S = 600.0  # a shared 2-core host under load

# The engine's process: sglang.Engine in-process, and the RL framework's own HTTP front of it.
ENGINE_SCRIPT = r'''
import json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main():
    model_dir, kwargs = sys.argv[1], json.loads(sys.argv[2])
    import sglang

    engine = sglang.Engine(model_path=model_dir, **kwargs)
    info = json.dumps(engine.get_server_info(), default=str).encode()

    class Front(BaseHTTPRequestHandler):
        def do_GET(self):
            path = self.path.split("?")[0]
            body = info if path == "/server_info" else b"{}" if path == "/health" else None
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body or b'{"error": "not served"}')

        def log_message(self, *args):
            pass

    front = ThreadingHTTPServer(("127.0.0.1", 0), Front)
    threading.Thread(target=front.serve_forever, daemon=True).start()
    print("READY " + json.dumps({"front": front.server_address[1]}), flush=True)
    sys.stdin.readline()  # the test is done
    front.shutdown()
    engine.shutdown()


if __name__ == "__main__":
    main()
'''


def engine_kwargs(flags: tuple[str, ...]) -> dict:
    """Command-line flags as ``sglang.Engine`` keywords (``--mem-fraction-static 0.5`` -> 0.5)."""
    kwargs, i = {}, 0
    while i < len(flags):
        name = flags[i].removeprefix("--").replace("-", "_")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            raw = flags[i + 1]
            for kind in (int, float):
                try:
                    raw = kind(raw)
                    break
                except ValueError:
                    pass
            kwargs[name], i = raw, i + 2
        else:
            kwargs[name], i = True, i + 1
    return kwargs


class InProcessEngine:
    """The engine's process: started, waited for (its front's port), stopped with its process group."""

    def __init__(self, model_dir: str, root, bootstrap_port: int):
        script = root / "inprocess_engine.py"
        script.write_text(ENGINE_SCRIPT)
        self.log_path, self.ready_path = str(root / "inprocess.log"), root / "inprocess.ready"
        kwargs = engine_kwargs((*CPU_SERVER_FLAGS, SEED_FLAG, "--engine-info-bootstrap-port", str(bootstrap_port),
                                "--host", "127.0.0.1"))
        env = {**os.environ, "SGLANG_PLATFORM": PLATFORM, **MOONCAKE_LOOPBACK_ENV}
        with open(self.log_path, "w") as log, open(self.ready_path, "w") as ready:
            self.proc = subprocess.Popen([sys.executable, str(script), model_dir, json.dumps(kwargs)],
                                         stdin=subprocess.PIPE, stdout=ready, stderr=log, env=env,
                                         start_new_session=True)
        self.bootstrap_url = f"http://127.0.0.1:{bootstrap_port}"
        self.started = time.monotonic()
        self.front_url = ""

    def wait_ready(self) -> None:
        while True:
            for line in self.ready_path.read_text().splitlines():
                if line.startswith("READY "):
                    self.front_url = f"http://127.0.0.1:{json.loads(line[6:])['front']}"
                    return
            if self.proc.poll() is not None or time.monotonic() - self.started > STARTUP_TIMEOUT_S:
                pytest.fail(f"the in-process sglang.Engine did not start (exit {self.proc.poll()})\n"
                            f"--- last lines of {self.log_path} ---\n{log_tail(self.log_path)}", pytrace=False)
            time.sleep(0.5)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        try:
            self.proc.stdin.write(b"\n")
            self.proc.stdin.flush()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever outlived the engine's own shutdown
        except ProcessLookupError:
            pass
        self.proc.wait()


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The in-process Engine and a launched server, started together (their start-ups overlap)."""
    root = tmp_path_factory.mktemp("sglang_inprocess")
    model_dir = write_config("qwen3", str(root))
    engine = InProcessEngine(model_dir, root, free_port())
    server = start_sglang_server(model_dir, str(root / "server.log"), seed_via_mooncake=True)
    try:
        engine.wait_ready()
        server.wait_healthy(timeout=STARTUP_TIMEOUT_S)
        yield SimpleNamespace(engine=engine, server=server, model_dir=model_dir)
    finally:
        engine.stop()
        stop([server])


def test_every_rank_publication_of_an_inprocess_engine_carries_the_refusal(engines):
    answer = get_json(f"{engines.engine.bootstrap_url}/get_transfer_engine_info?rank=0")
    assert answer["remote_instance_transfer_engine_info"][1], "the rank published its weights (sglang's seed flag)"
    assert answer[REFUSED_KEY] == inprocess.WHY
    with pytest.raises(UnsupportedLayout, match=r"engine inproc rank 0 refuses p2pweights' one-sided writes.*"
                                                r"in-process engine.*sglang\.launch_server"):
        EnginePublication.from_json(answer).check_not_refused(engine="inproc")


def test_a_sender_refuses_to_connect_to_an_inprocess_engine_naming_it_and_why(engines):
    client = SglangEngine(engines.engine.front_url, bootstrap_url=engines.engine.bootstrap_url, name="inproc")
    sender = WeightSender(engines.model_dir, transport="mooncake", buffer_size=1 << 20)
    try:
        with pytest.raises(UnsupportedLayout) as caught:
            sender.connect([client])
        assert caught.value.engine == "inproc" and caught.value.rank == 0
        assert "in-process engine" in str(caught.value)
        assert "run the engine as a server (python -m sglang.launch_server" in str(caught.value)
        assert sender.engines == [], "nothing was attached"
    finally:
        sender.close()


def test_an_inprocess_engine_says_why_in_its_log_and_its_server_info(engines):
    log = engines.engine.log()
    assert "this in-process engine's ranks publish their weights for one-sided writes" in log, log[-3000:]
    assert inprocess.WHY in log
    info = get_json(f"{engines.engine.front_url}/server_info")  # the engine's own get_server_info()
    assert info["p2pw_plugin"]["offers"] == []
    assert info["p2pw_plugin"]["error"] == inprocess.WHY


def test_a_launched_server_is_not_refused(engines):
    info = engines.server.get_json("/server_info")
    assert "error" not in info["p2pw_plugin"] and "sessions" in info["p2pw_plugin"]["offers"]
    answer = engines.server.get_json("/remote_instance_transfer_engine_info?rank=0")
    assert REFUSED_KEY not in answer and answer["epoch"] == 1
    assert "in-process" not in log_tail(engines.server.log_path, 400)


def test_a_publication_without_the_key_is_not_refused_and_the_key_round_trips():
    table = {"remote_instance_transfer_engine_info": ["127.0.0.1:1", {"w": [4096, 4, 2]}], "rank": 0}
    EnginePublication.from_json(table).check_not_refused(engine="e0")
    refused = EnginePublication.from_json({**table, REFUSED_KEY: "why"})
    assert EnginePublication.from_json(refused.to_dict()).refused == "why"
    with pytest.raises(UnsupportedLayout, match="engine e0 rank 0 refuses .*: why"):
        refused.check_not_refused(engine="e0")


def test_no_engine_on_the_stack_outside_sglang_engine_init():
    assert not inprocess.engine_on_stack()
