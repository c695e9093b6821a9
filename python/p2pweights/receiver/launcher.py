"""Starting engine-rank processes: the fork server and its client, and the environment of a rank.

The fork server (``python -m p2pweights.receiver.launcher``, :func:`run_launcher`) imports sglang
once (the slow part: 6-25 s on 2 cores), then forks one rank process per request, so an engine
starts in about the time its model takes to build. Forking a process that runs threads is unsafe
(a lock another thread held at the fork stays locked forever in the child), so its main loop is
single-threaded and starts no thread: one ``select`` over its stdin (the requests) and a wake-up
pipe that SIGCHLD and SIGTERM write to; it reaps its children and watches its parent from the same
loop. Protocol, one JSON object per line:

- stdin: ``{"op": "spawn", "id": N, "argv": [...], "log": PATH, "env": {...}}`` (``argv``: the rank
  process's arguments, see :mod:`p2pweights.receiver.rank_process`; ``env``: variables set in the
  rank before it starts, e.g. the engine's ``P2PW_API_KEY``, which must not be an argument that
  every local user can read in the process list);
- stdout: ``{"event": "launcher_ready", "pid", "os_threads"}``, ``{"event": "spawned", "id",
  "pid", "threads", "os_threads"}`` (the Python and OS threads of the launcher at the moment it
  forked), each rank's ready line, ``{"event": "exit", "pid", "code"}``.

It exits, killing its ranks, when its parent goes away, its stdin closes or it gets SIGTERM.
:class:`Launcher` is the client: one per Python process, started lazily.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

from ..errors import EngineError
from ..replica import sglang_env
from .rank_process import READY_EVENT
from .rank_process import main as run_rank_process

LAUNCHER_MODULE = "p2pweights.receiver.launcher"


def child_env(extra: dict | None = None) -> dict:
    """The environment of a rank process: this one's, the package importable, UCX set for loopback."""
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("UCX_MODULES", "^efa")           # NIXL segfaults at exit without it where rdma-core is
    try:
        has_rdma = bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        has_rdma = False
    if not has_rdma:
        env.setdefault("UCX_NET_DEVICES", "lo")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


# ---- the fork server -----------------------------------------------------------------------------

def _emit(**msg: Any) -> None:
    # one write(2) of one short line: atomic even when forked ranks share this stdout pipe
    os.write(1, (json.dumps(msg) + "\n").encode())


def os_threads() -> int:
    """Threads of this process as the OS counts them (native ones included)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _reap(children: set[int]) -> None:
    """Collect every child that exited, without blocking; report each."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        children.discard(pid)
        _emit(event="exit", pid=pid, code=os.waitstatus_to_exitcode(status))


def _shutdown(children: set[int]) -> None:
    for pid in list(children):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 5
    while children and time.monotonic() < deadline:
        _reap(children)
        time.sleep(0.1)
    for pid in list(children):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _reap(children)


def _fork_rank(req: dict, wake: tuple[int, int]) -> int:
    """Fork one rank process; in the child, run it and never return."""
    argv, log = list(req["argv"]), str(req["log"])
    env = {str(k): str(v) for k, v in (req.get("env") or {}).items()}
    pid = os.fork()
    if pid:
        return pid
    try:  # the rank process: none of the fork server's signal wiring, its own stderr
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        for fd in wake:
            os.close(fd)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        sys.stdin = open(os.devnull)
        sys.stderr = os.fdopen(2, "w", buffering=1)
        os.environ.update(env)
        run_rank_process(argv + ["--parent-pid", str(os.getppid())])
    except BaseException:  # noqa: BLE001 - into the rank's log, then exit
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(1)


def run_launcher() -> int:
    """The fork server: import sglang once, then fork rank processes on request, from one thread."""
    sglang_env.prepare()                       # the slow part (seconds), done once
    parent = os.getppid()
    children: set[int] = set()
    wake = os.pipe()
    for fd in wake:
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake[1])              # a signal wakes the select below at once
    signal.signal(signal.SIGCHLD, lambda *_: None)
    terminated: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: terminated.append(True))
    _emit(event="launcher_ready", pid=os.getpid(), os_threads=os_threads())
    pending = b""
    try:
        while not terminated:
            readable, _, _ = select.select([0, wake[0]], [], [], 0.5)
            if wake[0] in readable:
                while True:
                    try:
                        if not os.read(wake[0], 512):
                            break
                    except BlockingIOError:
                        break
            _reap(children)
            if os.getppid() != parent:
                break
            if 0 not in readable:
                continue
            chunk = os.read(0, 1 << 16)
            if not chunk:
                break  # stdin closed: the client is gone
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                try:
                    req = json.loads(line)
                except ValueError:
                    continue
                if not isinstance(req, dict) or req.get("op") != "spawn":
                    continue
                threads, native = threading.active_count(), os_threads()
                pid = _fork_rank(req, wake)
                children.add(pid)
                _emit(event="spawned", id=req.get("id"), pid=pid, threads=threads, os_threads=native)
    finally:
        _shutdown(children)
    return 0


# ---- the client: this process's launcher ----------------------------------------------------------

class ForkedRank:
    """A rank process forked by the launcher; the parts of ``subprocess.Popen`` LocalEngine uses."""

    def __init__(self, launcher: "Launcher", pid: int):
        self.launcher, self.pid = launcher, pid
        self.stdout = None

    @property
    def returncode(self) -> int | None:
        return self.launcher.exit_codes.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        event = self.launcher.exited(self.pid)
        if not event.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Launcher:
    """The fork server of this process (one per process, started lazily by :meth:`get`). Its
    environment is fixed when it starts. ``forks``: the launcher's ``spawned`` events."""

    _instance: "Launcher | None" = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls, env: dict, log_dir: str) -> "Launcher":
        with cls._instance_lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = cls(env, log_dir)
            return cls._instance

    @classmethod
    def current(cls) -> "Launcher | None":
        return cls._instance

    def __init__(self, env: dict, log_dir: str):
        self.log_path = os.path.join(log_dir, "launcher.log")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", LAUNCHER_MODULE],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
        log.close()
        self.exit_codes: dict[int, int] = {}
        self.ready_event: dict = {}
        self.forks: list[dict] = []
        self._exited: dict[int, threading.Event] = {}
        self._spawned: dict[int, Any] = {}
        self._ready_handlers: dict[int, Callable[[dict], None]] = {}
        self._pending_ready: dict[int, dict] = {}
        self._lock = threading.Lock()
        self._next = 0
        self._up = threading.Event()
        threading.Thread(target=self._read, name="p2pw-launcher-stdout", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            event = msg.get("event") if isinstance(msg, dict) else None
            with self._lock:
                if event == "launcher_ready":
                    self.ready_event = msg
                    self._up.set()
                elif event == "spawned":
                    self.forks.append(msg)
                    slot = self._spawned.get(msg["id"])
                    if slot is not None:
                        slot["pid"] = msg["pid"]
                        slot["event"].set()
                elif event == "exit":
                    self.exit_codes[msg["pid"]] = msg["code"]
                    self._exited.setdefault(msg["pid"], threading.Event()).set()
                    handler = self._ready_handlers.pop(msg["pid"], None)
                    if handler:
                        handler({})
                elif event == READY_EVENT:
                    handler = self._ready_handlers.pop(msg.get("pid"), None)
                    if handler:
                        handler(msg)
                    else:
                        self._pending_ready[msg.get("pid")] = msg
        with self._lock:  # the launcher died: so did every rank (they watch it)
            self._up.set()
            for ev in self._exited.values():
                ev.set()
            for slot in self._spawned.values():
                slot["event"].set()

    def exited(self, pid: int) -> threading.Event:
        with self._lock:
            return self._exited.setdefault(pid, threading.Event())

    def spawn(self, argv: list[str], log: str, on_ready: Callable[[dict], None], timeout: float,
              env: dict | None = None) -> ForkedRank:
        if not self._up.wait(timeout) or self.proc.poll() is not None:
            raise EngineError(f"the receiver launcher did not start; log {self.log_path}:\n{tail(self.log_path)}")
        with self._lock:
            self._next += 1
            ident = self._next
            slot = self._spawned[ident] = {"event": threading.Event(), "pid": None}
        request = {"op": "spawn", "id": ident, "argv": argv, "log": log, "env": dict(env or {})}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        if not slot["event"].wait(timeout) or slot["pid"] is None:
            raise EngineError(f"the receiver launcher did not fork; log {self.log_path}:\n{tail(self.log_path)}")
        pid = slot["pid"]
        with self._lock:
            del self._spawned[ident]
            early = self._pending_ready.pop(pid, None)
            if early is None and pid in self.exit_codes:
                early = {}
            if early is None:
                self._ready_handlers[pid] = on_ready
        if early is not None:
            on_ready(early)
        return ForkedRank(self, pid)


def tail(path: str, lines: int = 30) -> str:
    """The last lines of a log file ("" when it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


if __name__ == "__main__":
    os._exit(run_launcher())
