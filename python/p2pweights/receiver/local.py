"""Engines of rank processes on this host, from Python (the tests, the demo, the benchmarks)::

    engine = start_engine(config_dir, "tp=2", transport="mooncake", name="engine0")  # T processes (default: auto)
    engine.url                              # http://127.0.0.1:PORT, sglang's routes (api_key=: keyed)
    check_weights_equal(engine.url, hf_seed=7)  # {"success", "message", "ranks": [...]}
    engine.kill(rank=1); engine.restart()     # faults: same port again
    engine.close()

Ranks are forked by this process's launcher (``launch="fork"``, the default, ``P2PW_RECEIVER_LAUNCH``)
or each started as a fresh interpreter (``launch="spawn"``); see :mod:`p2pweights.receiver.launcher`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

from ..control import protocol, routes
from ..control.http import request
from ..errors import EngineError, EngineUnreachable
from ..models.engine_layout import EngineLayout
from ..settings import value as setting
from ..transport import resolve_transport
from .launcher import Launcher, child_env, tail
from .rank_process import READY_EVENT
from .rank_server import CONNECT_TIMEOUT, RANK_TIMEOUT

RANK_PROCESS_MODULE = "p2pweights.receiver.rank_process"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the engine's port, fixed so restarts reuse it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalEngine:
    """An engine of T rank processes on this host (``start_engine`` starts one): ``url``, ``pids``,
    ``kill(rank)``, ``restart()``, ``close()``. Restarts reuse the leader's port. ``api_key``
    (default ``P2PW_API_KEY``): the engine's key, given to its ranks in their environment.
    ``transport`` (default ``P2PW_TRANSPORT``, ``auto``): resolved here, once, for every rank
    (``transport.resolve_transport``: nixl where NIXL's native path loads, else mooncake); ``transport_why``
    says why."""

    def __init__(self, model: str, engine: str = "tp=1", *, transport: str | None = None, name: str = "engine0",
                 host: str = "127.0.0.1", port: int = 0, env: dict | None = None, startup_timeout: float = 120.0,
                 log_dir: str | None = None, launch: str | None = None, broadcast_receiver: str | None = None,
                 api_key: str | None = None, lora: Any = None):
        self.model = os.fspath(model)
        self.lora = lora  # a LoRASetting: sglang's adapter pool on every rank (adapter_pool.py)
        self.engine = engine
        self.world = EngineLayout.parse(engine).world_size
        self.transport, self.transport_why = resolve_transport(transport)
        self.name = name
        self.host = host
        self.port = int(port)
        self.env = child_env(env)
        self.startup_timeout = startup_timeout
        self.log_dir = log_dir or tempfile.mkdtemp(prefix=f"p2pw-{name}-")
        self.launch = setting("P2PW_RECEIVER_LAUNCH", launch)
        self.broadcast_receiver = broadcast_receiver
        self.api_key: str | None = setting("P2PW_API_KEY", api_key)
        self.procs: dict[int, Any] = {}
        self.ready: dict[int, dict] = {}
        # the control port of each rank >= 1, picked here and given to it and to the leader, which
        # calls (and sends the key to) no other URL (registration.RankEndpoints); kept across restarts
        self.rank_ports: dict[int, int] = {}
        self._ready_events: dict[int, threading.Event] = {}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def log_path(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"rank{rank}.log")

    def _spawn(self, rank: int) -> None:
        args = ["--model", self.model, "--engine", self.engine, "--rank", str(rank), "--name", self.name,
                "--transport", self.transport, "--host", self.host]
        if rank == 0:
            args += ["--port", str(self.port)]
            if self.rank_ports:
                args += ["--rank-ports", ",".join(str(self.rank_ports[r]) for r in range(1, self.world))]
        else:
            args += ["--leader", self.url, "--port", str(self.rank_ports[rank])]
        if self.broadcast_receiver is not None:
            args += ["--broadcast-receiver", self.broadcast_receiver]
        if self.lora is not None:
            args += ["--lora", json.dumps(dataclasses.asdict(self.lora))]
        event = self._ready_events[rank] = threading.Event()
        self.ready.pop(rank, None)
        if self.launch == "fork":
            def on_ready(msg: dict, rank: int = rank) -> None:
                if msg:
                    self.ready[rank] = msg
                event.set()

            launcher = Launcher.get(self.env, self.log_dir)
            self.procs[rank] = launcher.spawn(args, self.log_path(rank), on_ready, self.startup_timeout,
                                              env=self._key_env())
            return
        cmd = [sys.executable, "-m", RANK_PROCESS_MODULE, *args, "--parent-pid", str(os.getpid())]
        log = open(self.log_path(rank), "ab")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL,
                                env={**self.env, **self._key_env()})
        log.close()
        self.procs[rank] = proc

        def read() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if isinstance(msg, dict) and msg.get("event") == READY_EVENT:
                    self.ready[rank] = msg
                    event.set()
            event.set()  # EOF: the process ended
        threading.Thread(target=read, name=f"p2pw-{self.name}-rank{rank}-stdout", daemon=True).start()

    def _key_env(self) -> dict:
        # always set, "" when there is none: the launcher's own environment may hold another key
        return {"P2PW_API_KEY": self.api_key or ""}

    def start(self, wait: bool = True) -> "LocalEngine":
        """Spawn every rank at once (ranks >= 1 register with the leader when it is up)."""
        pick_port, pick_ranks = self.port == 0, not self.rank_ports
        for attempt in range(3):
            if pick_port:
                self.port = free_port(self.host)
            if pick_ranks:
                local = self.host if self.host not in ("", "::") else "127.0.0.1"  # a wildcard: free here
                self.rank_ports = {r: free_port(local) for r in range(1, self.world)}
            for rank in range(self.world):
                self._spawn(rank)
            if not wait:
                return self
            try:
                return self.wait_ready()
            except EngineError as e:
                # a port picked here is free when picked, not when the leader binds it: another
                # process may take it in between; pick again (a port the caller chose is kept)
                if not (pick_port or pick_ranks) or attempt == 2 or not lost_its_port(e):
                    raise
        return self

    def wait_ready(self, timeout: float | None = None) -> "LocalEngine":
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        for rank in range(self.world):
            event = self._ready_events[rank]
            if not event.wait(max(0.0, deadline - time.monotonic())) or rank not in self.ready:
                code = self.procs[rank].poll()
                state = f"exited with code {code}" if code is not None else "not ready in time"
                self.close()
                raise EngineError(f"engine {self.name} rank {rank} {state}; log {self.log_path(rank)}:\n"
                                  f"{tail(self.log_path(rank))}")
        return self

    def kill(self, rank: int | None = None, sig: int = signal.SIGKILL) -> None:
        """Kill one rank process (``rank``) or all of them, and reap them."""
        for r in [rank] if rank is not None else list(self.procs):
            proc = self.procs.get(r)
            if proc is not None and proc.poll() is None:
                proc.send_signal(sig)
        for r in [rank] if rank is not None else list(self.procs):
            proc = self.procs.get(r)
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)

    def alive(self) -> dict[int, bool]:
        return {r: p.poll() is None for r, p in self.procs.items()}

    def restart(self, wait: bool = True) -> "LocalEngine":
        """Stop every rank still running, then start the engine again on the same port."""
        self.close()
        self.procs.clear()
        return self.start(wait=wait)

    def close(self, timeout: float = 10.0) -> None:
        """SIGTERM every rank (clean exit), SIGKILL what is left after ``timeout``."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            if proc.stdout is not None:
                proc.stdout.close()

    def __enter__(self) -> "LocalEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LocalEngine({self.name!r}, {self.engine!r}, {self.transport}, url={self.url})"


def start_engine(model: str, engine: str = "tp=1", **kwargs: Any) -> LocalEngine:
    """Start an engine of T rank processes (T from ``engine``) and wait until every rank is ready."""
    return LocalEngine(model, engine, **kwargs).start()


def lost_its_port(error: EngineError) -> bool:
    """The leader could not bind its port (taken by another process since it was picked)."""
    return "Address already in use" in str(error)


def start_engines(model: str, engine: str = "tp=1", count: int = 1, *, name_prefix: str = "engine",
                  **kwargs: Any) -> list[LocalEngine]:
    """Start ``count`` engines at once (every rank process in parallel) and wait for all of them."""
    return start_together([LocalEngine(model, engine, name=f"{name_prefix}{i}", **kwargs) for i in range(count)])


def start_together(engines: Sequence[LocalEngine], meanwhile: Callable[[], Any] | None = None) -> list[LocalEngine]:
    """Spawn every rank of ``engines`` at once, run ``meanwhile`` (work that overlaps their start-up),
    then wait for all of them. An engine whose picked port another process took before its leader
    bound it (ports are picked free, then bound seconds later) starts again on newly picked ports.
    On any failure every engine is closed and the error raised."""
    picked = [e.port == 0 for e in engines]
    try:
        for e in engines:
            e.start(wait=False)
        if meanwhile is not None:
            meanwhile()
        for e, pick in zip(engines, picked):
            try:
                e.wait_ready()
            except EngineError as err:
                if not (pick and lost_its_port(err)):
                    raise
                e.port = 0  # another process took a picked port before the leader (or a rank) bound it
                e.rank_ports = {}
                e.procs.clear()
                e.start()  # picks again, with start's own retries
    except BaseException:
        for e in engines:
            e.close()
        raise
    return list(engines)


def check_weights_equal(url: str, hf_seed: int, skip: Sequence[str] = (), timeout: float = RANK_TIMEOUT, *,
                        api_key: str | None = None, changed_fraction: float | None = None,
                        changed_steps: int | None = None) -> dict:
    """Ask an engine (its leader's URL) for the equality check after an update made from
    ``random_checkpoint(specs, hf_seed)``: ``POST /weights_checker {"action": "p2pw_compare",
    "hf_seed": N}``. Returns the answer (``success``, ``message``, ``ranks``, ``mismatches``)
    whether equal or not; raises EngineError only when the check could not run. ``api_key``: the
    engine's key (default ``P2PW_API_KEY``). ``changed_fraction`` with ``changed_steps``: the update
    was ``random_checkpoint(specs, hf_seed, changed=(changed_fraction, changed_steps))``."""
    body: dict[str, Any] = {"action": "p2pw_compare", "hf_seed": int(hf_seed)}
    if changed_fraction is not None or changed_steps is not None:  # one without the other: the engine's 400
        body.update(changed_fraction=changed_fraction, changed_steps=changed_steps)
    if skip:
        body["skip_tensor_list"] = list(skip)
    try:
        status, payload = request("POST", url, routes.route("weights_checker").path, body=body, timeout=timeout,
                                  connect_timeout=CONNECT_TIMEOUT, api_key=setting("P2PW_API_KEY", api_key))
    except EngineUnreachable as e:
        raise EngineError(f"engine {url}: the equality check could not reach it: {e.message}") from e
    if status not in (protocol.OK, protocol.BAD_REQUEST) or not isinstance(payload, dict) or "success" not in payload:
        raise EngineError(f"engine {url}: the equality check failed: HTTP {status}: {str(payload)[:500]}")
    if status == protocol.BAD_REQUEST and "ranks" not in payload:
        raise EngineError(f"engine {url}: the equality check could not run: {payload.get('message')}")
    return payload
