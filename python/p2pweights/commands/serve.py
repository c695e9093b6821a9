"""`p2pweights serve`: one receiver engine (all its ranks) in the foreground, serving sglang's routes.

A trainer author tests against it with no GPU: the engine's ranks hold an sglang model of the
given config (random weights until the first update) in host memory, publish it over Mooncake or
NIXL, and answer sglang's control routes on ``--host:--port``. Ready when ``GET /health`` answers
200: then one line ``p2pweights serve: ready URL ...`` goes to stdout (progress to stderr). SIGTERM
or SIGINT stops every rank cleanly (then the launcher that forked them) and exits 0; a rank that
dies on its own stops the others and exits 1.

With ``--api-key`` (or ``P2PW_API_KEY``, which keeps the key out of the process list) every route
but the health routes answers 401 without ``Authorization: Bearer KEY``; docs/security.md says what
the key protects and what it does not.
"""
from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from typing import Any

from ..models.engine_layout import EngineLayout
from ..settings import TRANSPORTS
from ..settings import value as setting

READY = "ready"
_WILDCARDS = ("0.0.0.0", "::", "", "127.0.0.1", "localhost")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen3-0.6b",
                   help="built-in shape (qwen3-0.6b, qwen3-4b, qwen3-30b-a3b, deepseek-v3) or a config dir; "
                        "random weights until the first update (default: %(default)s)")
    p.add_argument("--engine", default="tp=1",
                   help="the engine's layout: tp=..,ep=..,dp_attention=..[,<sglang server arg>=<value>]; a key "
                        "that does not decide a rank's bytes is refused (default: %(default)s)")
    p.add_argument("--port", type=int, default=30000, help="the engine's HTTP port, sglang's routes "
                                                           "(0: any free port; default: %(default)s)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address the engine's HTTP server and its ranks' internal endpoints bind to; a "
                        "specific address is also what its transfer engines advertise, unless P2PW_HOSTNAME "
                        "is set (default: %(default)s)")
    p.add_argument("--transport", choices=(*TRANSPORTS, "auto"), default=None,
                   help="P2P transport; auto: nixl where NIXL's native C-API path loads (its listeners bind only "
                        "the configured devices' addresses), else mooncake (listens on every interface: "
                        "docs/security.md) (default: P2PW_TRANSPORT, else auto)")
    p.add_argument("--api-key", default=None,
                   help="require Authorization: Bearer KEY on every route but health (default: P2PW_API_KEY; "
                        "prefer the variable: a command line is visible to every local user)")
    p.add_argument("--name", default="engine0", help="the engine's name in logs and errors (default: %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds for every rank to be ready (default: %(default)s)")
    p.add_argument("--log-dir", default=None, help="where each rank's log goes (default: a new temporary folder)")
    p.add_argument("--enable-lora", action="store_true",
                   help="sglang's LoRA pool on every rank (sglang's flags below): adapters are loaded by "
                        "POST /load_lora_adapter (pinned) and updated by sender.update(step, adapter=...) (docs/lora.md)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="with --enable-lora (default: %(default)s)")
    p.add_argument("--max-loras-per-batch", type=int, default=8,
                   help="with --enable-lora: the pool's slots, slot 0 the base model's (default: %(default)s)")
    p.add_argument("--lora-target-modules", nargs="+", default=None,
                   help="with --enable-lora (default: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj)")


def run(args: argparse.Namespace) -> int:
    from ..models import UnknownModel, resolve_model

    # refused before any rank starts: an unknown model, an --engine key the ranks would not honour
    try:
        model = resolve_model(args.model)
    except UnknownModel as e:
        raise UnknownModel(f"--model: {e}") from None
    layout = EngineLayout.parse(args.engine, command="serve")
    from ..transport import resolve_transport

    transport, why = resolve_transport(args.transport)
    if why:
        _progress(f"p2pweights serve: transport {transport} ({why})")
    api_key = setting("P2PW_API_KEY", args.api_key)
    env = {}
    if args.host not in _WILDCARDS and not setting("P2PW_HOSTNAME"):
        env["P2PW_HOSTNAME"] = args.host  # remote senders reach the transfer engines where they reach HTTP
    lora = None
    if args.enable_lora:
        from ..replica.lora_layout import DENSE_TARGETS, LoRASetting

        lora = LoRASetting(max_lora_rank=args.max_lora_rank, target_modules=tuple(args.lora_target_modules or
                                                                                  DENSE_TARGETS),
                           max_loras_per_batch=args.max_loras_per_batch, lora_backend="torch_native")
    return Serve(model, args.engine, transport=transport, host=args.host, port=args.port, api_key=api_key,
                 name=args.name, world=layout.world_size, env=env, startup_timeout=args.startup_timeout,
                 log_dir=args.log_dir, lora=lora).run()


class _Stop(Exception):
    """SIGTERM/SIGINT arrived while the engine was starting."""


class Serve:
    """The foreground lifetime of one engine: start, announce, watch, stop on a signal."""

    def __init__(self, model: str, engine: str, *, transport: str, host: str, port: int, api_key: str | None,
                 name: str, world: int, env: dict, startup_timeout: float, log_dir: str | None, lora: Any = None):
        self.model, self.engine_spec, self.transport = model, engine, transport
        self.host, self.port, self.api_key, self.name, self.world = host, port, api_key, name, world
        self.env, self.startup_timeout, self.log_dir = env, startup_timeout, log_dir
        self.lora = lora
        self.stop = threading.Event()
        self.starting = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop.set()
        if self.starting:
            raise _Stop(signal.Signals(signum).name)

    def run(self) -> int:
        from ..receiver.local import LocalEngine, free_port

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        port = self.port or free_port(self.host if self.host not in ("", "::") else "127.0.0.1")
        engine = LocalEngine(self.model, self.engine_spec, transport=self.transport, name=self.name, host=self.host,
                             port=port, env=self.env, startup_timeout=self.startup_timeout, log_dir=self.log_dir,
                             api_key=self.api_key, lora=self.lora)
        _progress(f"p2pweights serve: starting engine {self.name}: model {self.model}, {self.engine_spec} "
                  f"({self.world} rank(s)), transport {self.transport}, on {engine.url}; rank logs in {engine.log_dir}")
        code = 0
        try:
            self.starting = True
            started = time.monotonic()
            engine.start()
            self._wait_healthy(engine.url, started + self.startup_timeout)
            self.starting = False
            print(f"p2pweights serve: {READY} {engine.url} engine {self.name} {self.engine_spec} ({self.world} "
                  f"rank(s)), transport {self.transport}, api key {'required' if self.api_key else 'off'}, "
                  f"{time.monotonic() - started:.1f}s", flush=True)
            while not self.stop.wait(0.5):
                dead = sorted(r for r, alive in engine.alive().items() if not alive)
                if dead:
                    _progress(f"p2pweights serve: engine {self.name}: rank(s) {dead} exited on their own "
                              f"(logs: {', '.join(engine.log_path(r) for r in dead)}); stopping the others")
                    code = 1
                    break
        except _Stop as e:
            _progress(f"p2pweights serve: {e} during start-up; stopping")
        finally:
            self.starting = False
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean stop short
            engine.close()
            _stop_launcher()
        _progress(f"p2pweights serve: engine {self.name} stopped")
        return code

    def _wait_healthy(self, url: str, deadline: float) -> None:
        from ..control import protocol, routes
        from ..control.http import request
        from ..errors import EngineError, EngineUnreachable

        path = routes.route("health").path
        while True:
            try:
                status, _ = request("GET", url, path, timeout=5.0, connect_timeout=2.0)
                if status == protocol.OK:
                    return
            except EngineUnreachable:
                status = None
            if time.monotonic() > deadline:
                raise EngineError(f"engine {self.name}: GET {url}{path} did not answer 200 within the start-up "
                                  f"timeout (last: {status})", engine=self.name)
            time.sleep(0.2)


def _stop_launcher() -> None:
    """Stop this process's fork server, which stops any rank it forked that is still running."""
    from ..receiver.launcher import Launcher

    launcher = Launcher.current()
    if launcher is None or launcher.proc.poll() is not None:
        return
    launcher.proc.terminate()
    try:
        launcher.proc.wait(15)
    except Exception:  # noqa: BLE001 - a launcher that does not stop is killed
        launcher.proc.kill()
        launcher.proc.wait(5)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
