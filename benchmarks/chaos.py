"""A chaos run: many updates on two engines, faults at random points, the invariant after each (issue 23).

    PYTHONPATH=python python3 benchmarks/chaos.py [--updates 200] [--transport mooncake|nixl] [--seed N]
                                                  [--faults none,kill,...] [--unfenced] [--unrevoked]
                                                  [--engine-kind receiver|sglang] [--engines tp=2,tp=2]
                                                  [--json] [--out FILE]

Two engines and sender processes (each its own controller), all with ``P2PW_SESSION_LEASE=2``. The
engines are our receiver (``--engine-kind receiver``, the default: tiny qwen3, tp=2 each, real rank
processes) or REAL sglang 0.5.23 CPU servers with the p2pweights plugin (``--engine-kind sglang``:
``python -m sglang.launch_server`` on the ``p2pw_cpu`` platform, tiny qwen3 with intermediate size 128
so that a tp=2 CPU rank is not padded, weights published over Mooncake TCP with sglang's own seed
flag; Mooncake only, tp=1 and tp=2 by default). Each update draws one fault from a seeded RNG (the
seed is printed; ``--seed`` replays the draws, not the timing):

  none          a complete update
  kill          the sender is SIGKILLed after its writes began (at a random tensor)
  late          the sender is SIGSTOPped after its writes began, held past the engines' lease; another
                controller commits a complete update (a takeover: the engines revoke the old epoch);
                the late sender is SIGCONTed and pushes the rest: not one of its bytes may land
  concurrent    two controllers start at once: at most one commits, the other is refused
  nan           a pushed tensor holds NaN with check_finite=True: refused (before the pause when first)
  expiry        the sender is SIGSTOPped after its writes began, left past the lease, then SIGKILLed
  engine_stop   a rank of one engine is SIGSTOPped for 1 s (within its watchdog's ~2 s) mid-update
  churn faults (issue "Elastic engine sets"; the long-lived main sender keeps its engine set):
  restart       an engine is restarted at the same address between updates (another process: new
                registrations, no base); the main sender's next update must re-plan it and write it in full
  down          an engine is killed; the update runs with on_engine_down="skip": the other commits, the
                dead one is named in engines_skipped; it is restarted (its start-up weights) afterwards
  kill_mid      an engine is killed after the update's writes began (skip): it fails alone, the other
                commits; restarted afterwards
  leave_join    the main sender removes an engine, updates the rest, and adds it back (its next update
                writes it in full); the engine left out keeps its version and bytes

After every update, each engine must either report version ``seedN`` (or its start-up version before
any commit) and hold exactly the bytes of ``random_checkpoint(specs, N)`` with no session open, or be
torn: ``/server_info`` ``p2pw_weight_update.state`` is torn and so is ``/health`` (a real sglang
server's ``/health`` is sglang's own, which never says torn: docs/sglang.md; ``/server_info`` alone
there), and the engine refuses to continue. Anything else is a wrong-bytes count (must be 0). Our
receiver's bytes are compared by its ranks (``check_weights_equal``); a real sglang server's with
sglang's own ``/weights_checker`` checksums against those of sglang's own loader
(``sglang_plugin/weight_checksums.py``). An engine that dies is restarted (counted). After a torn
engine the next update is a complete one (it heals it).

A late sender resumed is stopped either by the ENGINE (its post fails: the old epoch's endpoint was
revoked, "peer is gone" / REMOTE_DISCONNECTED or another transport error) or by the SENDER's own lease
fence (``FENCED``, "not posted: the session's lease ended"); the footer counts both.

``--unfenced`` measures the engine's revocation alone: every sender-side check of the lease is off in
the sender processes (``PipelinedWriter.fence``, the one entry into the native writer's fence, which
both the lease renewals and the epoch follow-up reach through ``sender/write_fence.py``, is a no-op,
so no write is ever refused for a lease on the sender's side). 0 wrong bytes served is the expected
result, and every late sender must be stopped by the engine (0 by the sender's fence).

``--unrevoked`` (with ``--unfenced``) is the harness's self-check: the engines' revocation is also off
(``benchmarks/chaos_unrevoked/sitecustomize.py``, loaded only by the engine processes: a takeover
opens the new epoch's endpoint but leaves the old one registered and connected), so nothing stops a
late sender and a run with late faults must report wrong bytes served.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

LEASE = "2"
os.environ["P2PW_SESSION_LEASE"] = LEASE  # engines and senders inherit it

from p2pweights.benchmarking.table import emit  # noqa: E402
from p2pweights.control import SglangEngine  # noqa: E402
from p2pweights.control import protocol as p  # noqa: E402
from p2pweights.receiver import check_weights_equal, start_engines  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from replica_configs import write_config  # noqa: E402

# --unrevoked: a sitecustomize that only the engine processes load (their PYTHONPATH), switching their
# revocation off when CHAOS_UNREVOKED=1 (the senders never get the variable)
UNREVOKED_DIR = os.path.join(HERE, "chaos_unrevoked")
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["p2pweights"].__file__)))
SGLANG_START_TIMEOUT_S = 900.0  # a loaded 2-core host: a server's start-up can take minutes

FAULTS = ["none", "kill", "late", "concurrent", "nan", "expiry", "engine_stop", "restart", "down", "kill_mid",
          "leave_join"]
WEIGHTS = [4, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1]

# One sender process: a loop of updates asked on stdin, one JSON line each; events on stdout.
CHILD = textwrap.dedent('''
    import json, os, sys, time
    import torch
    from p2pweights.errors import P2PWeightsError, SessionConflict
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
    from p2pweights.sender import WeightSender

    from p2pweights import _native

    cfg, transport = sys.argv[1:3]
    if os.environ.get("CHAOS_UNFENCED") == "1":  # --unfenced: no sender-side lease check at all
        # the one entry into the native writer's fence: the lease renewals (Update._fence_writes) and the
        # epoch follow-up (write_fence.follow_epochs) both reach it through write_fence.fence_engine
        from p2pweights.sender.writer import PipelinedWriter
        PipelinedWriter.fence = lambda self, engine, seconds: None
    CODE_NAMES = {int(v): k for k, v in _native.Code.__members__.items()}
    urls = sys.argv[3:]
    def say(**kw):
        print(json.dumps(kw), flush=True)
    sender = WeightSender(cfg, transport=transport, buffer_size=1 << 20)
    sender.connect(urls)
    specs = checkpoint_tensors(cfg)
    say(event="ready", pid=os.getpid(), tensors=len(list(random_checkpoint(specs, 0))))
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("cmd") in ("remove", "add"):  # the engine set changes between updates (engine_set.py)
            try:
                if job["cmd"] == "remove":
                    sender.remove_engines([m.name for m in sender.engines if m.url == job["url"]])
                else:
                    sender.add_engines([job["url"]])
                say(event="ok", engines={m.name: m.state for m in sender.engines})
            except P2PWeightsError as e:
                say(event="failed", error=str(e)[:2000], kind=type(e).__name__)
            continue
        seed, mode, at, go = job["seed"], job["mode"], job.get("at", 0), job.get("go")
        items = list(random_checkpoint(specs, seed))
        if mode == "nan":
            name, t = items[at]
            t = t.clone()
            t.view(-1)[0] = float("nan")
            items[at] = (name, t)
        while go and not os.path.exists(go):
            time.sleep(0.005)
        try:
            with sender.update(f"seed{seed}", check_finite=(mode == "nan") or None, force=True,
                               on_engine_down=job.get("down")) as update:
                for i, (name, t) in enumerate(items):
                    update.push(name, t)
                    if mode == "slow" and i == 0:
                        time.sleep(2.0)  # holds its session: the other controller certainly meets it
                    if mode in ("hold", "late", "pause") and i == at:
                        update.pipeline.drain()  # what is placed goes out now: its writes begin
                        if mode == "late":  # stopped between posts, not inside one (docs/security.md)
                            time.sleep(1.0)
                        say(event="writing", slots=update.times.slots)
                        if mode == "hold":
                            time.sleep(600)  # until stopped / killed
                        while not os.path.exists(go + ".resume"):
                            time.sleep(0.005)
            say(event="done", seed=seed, skipped=sorted(update.report.engines_skipped))
        except SessionConflict as e:
            say(event="refused", error=str(e)[:400], engine=e.engine)
        except P2PWeightsError as e:
            rep = getattr(e, "report", None)  # the writer's report: each failed engine rank's native code
            codes = {r.name: CODE_NAMES.get(int(r.code), str(r.code)) for r in getattr(rep, "engines", [])
                     if str(r.state) == "failed"}
            say(event="failed", error=str(e)[:2000], kind=type(e).__name__, codes=codes)
    os._exit(0)
''')


class Sender:
    """One controller: a sender process running updates on request."""

    def __init__(self, cfg: str, urls: list[str], transport: str, log: str):
        with open(log, "ab") as err:  # the transports' own chatter goes here, not into the run's output
            self.proc = subprocess.Popen([sys.executable, "-c", CHILD, cfg, transport, *urls], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, env=dict(os.environ))
        self.ready: dict | None = None

    def wait_ready(self) -> "Sender":
        if self.ready is None:
            self.ready = self.next_event(240)
            if self.ready.get("event") != "ready":
                raise RuntimeError(f"sender not ready: {self.ready}")
        return self

    def ask(self, **job) -> None:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def next_event(self, timeout: float = 180.0) -> dict:
        import select

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not r:
                break
            line = self.proc.stdout.readline()
            if not line:
                return {"event": "exited", "rc": self.proc.poll()}
            try:
                return json.loads(line)
            except ValueError:
                continue
        return {"event": "timeout"}

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass


class SglangChaosEngine:
    """A real sglang CPU server with the plugin, as the run sees an engine: ``name``, ``url``, ``world``,
    ``pids`` (its scheduler processes by tp rank), ``restart()``, ``close()``."""

    def __init__(self, model_dir: str, layout: str, name: str, log_dir: str, env: dict[str, str]):
        from p2pweights.models.engine_layout import EngineLayout

        self.model_dir, self.layout, self.name, self.log_dir, self.env = model_dir, layout, name, log_dir, env
        self.world = EngineLayout.parse(layout).tp_size
        self.starts = 0
        self.server = None

    def start(self) -> "SglangChaosEngine":
        from p2pweights.sglang_plugin.cpu_server import CpuSglangServer

        self.starts += 1
        log = os.path.join(self.log_dir, f"{self.name}.{self.starts}.log")
        self.server = CpuSglangServer.start(self.model_dir, log, tp=self.world, env=self.env, seed_via_mooncake=True,
                                            name=self.name)
        return self

    def wait(self) -> "SglangChaosEngine":
        self.server.wait_healthy(timeout=SGLANG_START_TIMEOUT_S)
        return self

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def pids(self) -> dict[int, int]:
        import psutil

        found = {}
        for child in psutil.Process(self.server.proc.pid).children(recursive=True):
            try:
                title = " ".join(child.cmdline()) or child.name()
            except psutil.Error:
                continue
            m = re.search(r"sglang::scheduler(\S*?TP(\d+))?", title)  # tp=1: no TP in sglang's process title
            if m:
                found[int(m.group(2) or 0)] = child.pid
        if len(found) != self.world:
            raise RuntimeError(f"{self.name}: scheduler processes {found} of tp={self.world}")
        return found

    def restart(self) -> "SglangChaosEngine":
        self.close()
        return self.start().wait()

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()


class SglangBytes:
    """What a real sglang server should hold after ``random_checkpoint(.., seed)``: sglang's own
    checksums of its loader's result, per layout and seed (computed once each)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._expected: dict[str, object] = {}
        self._of: dict[tuple[str, int], dict] = {}

    def check(self, engine: "SglangChaosEngine", seed: int) -> tuple[bool, str]:
        from p2pweights.models.engine_layout import EngineLayout
        from p2pweights.sglang_plugin.weight_checksums import ExpectedChecksums, check_engine

        if engine.layout not in self._expected:
            self._expected[engine.layout] = ExpectedChecksums(self.model_dir, EngineLayout.parse(engine.layout))
        if (engine.layout, seed) not in self._of:
            self._of[engine.layout, seed] = self._expected[engine.layout].of(seed)
        return check_engine(SglangEngine(engine.url, name=engine.name, timeout=120), self._of[engine.layout, seed])


def late_stop(ev: dict) -> str:
    """Who stopped a resumed late sender: ``engine`` (a post failed on the engine's side: its old epoch
    revoked), ``sender`` (its own lease fence refused a post: FENCED), ``none`` (no write of it failed),
    or ``committed``."""
    if ev.get("event") == "done":
        return "committed"
    codes = set((ev.get("codes") or {}).values())
    error = ev.get("error", "")
    if "FENCED" in codes or "not posted: the session's lease ended" in error:
        return "sender"
    if codes or "is gone" in error or "REMOTE_DISCONNECTED" in error:
        return "engine"
    return "none"


def state_of(url: str) -> dict:
    return SglangEngine(url, timeout=30).server_info()["p2pw_weight_update"]


def health_of(url: str):
    from p2pweights.control import http

    return http.request("GET", url, "/health", timeout=30)


class Chaos:
    def __init__(self, args):
        self.a = args
        self.rng = random.Random(args.seed)
        self.tmp = tempfile.mkdtemp(prefix="p2pw-chaos-")
        # sglang on the CPU pads an intermediate size that tp x 32 does not divide (96 at tp=2): 128 there
        self.cfg = write_config("qwen3", self.tmp, **({"intermediate_size": 128} if args.engine_kind == "sglang" else {}))
        self.sglang_bytes = SglangBytes(self.cfg) if args.engine_kind == "sglang" else None
        self.initial: list[str] = []  # each engine's version at start-up (its dummy weights: not checked)
        self.engines: list = []
        self.spares: list[Sender] = []
        self.main: Sender | None = None
        self.next_seed = 100
        self.tensors = 0
        self.rows = {f: {"fault": f, "updates": 0, "attempted": 0, "committed": 0, "refused": 0, "torn": 0,
                         "wrong": 0, "restarts": 0} for f in FAULTS}
        self.failures: list[str] = []
        self.go_n = 0
        self.sender_log = os.path.join(self.tmp, "senders.log")
        # the reference model: per engine, the versions it may serve (the last committed one; after an
        # update that failed, also what that update tried: a commit may reach one engine and not another)
        self.allowed: list[set[str]] = []
        self.tried: list[str] = []
        self.done: list[str] = []
        self.late = {"resumed": 0, "engine": 0, "sender": 0, "none": 0, "committed": 0}  # who stopped them
        self.late_codes: dict[str, int] = {}  # the native codes of the late senders' failed writes
        self.spare_failures = 0  # spare senders whose connect failed (it raced a takeover's revocation)
        self.skipped: set[int] = set()  # engines the last update was allowed to leave out (churn faults)
        self.churn = {"restarted": 0, "skipped": 0, "missed": 0, "rejoined": 0}  # what the churn faults saw

    def log(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    # -- processes ------------------------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def spare(self) -> Sender:
        """A fresh sender process (spawned ahead, one always warming). A spare whose connect failed (it
        fetched an engine's publication just before a takeover revoked that epoch: "peer ... is
        unreachable") is replaced by another, and counted."""
        for _ in range(5):
            while len(self.spares) < 2:
                self.spares.append(Sender(self.cfg, self.urls, self.a.transport, self.sender_log))
            s = self.spares.pop(0)
            try:
                s.wait_ready()
            except RuntimeError as e:
                self.spare_failures += 1
                self.log(f"  a spare sender did not start ({e}; its error is in {self.sender_log}): another one")
                s.close()
                continue
            self.spares.append(Sender(self.cfg, self.urls, self.a.transport, self.sender_log))
            return s
        raise RuntimeError("5 spare senders in a row did not start")

    def main_sender(self) -> Sender:
        if self.main is None or self.main.proc.poll() is not None:
            if self.main is not None:
                self.main.close()
            self.main = self.spare()
        return self.main

    def seed(self) -> int:
        self.next_seed += 1
        return self.next_seed

    def go_file(self) -> str:
        self.go_n += 1
        return os.path.join(self.tmp, f"go{self.go_n}")

    def run_one(self, sender: Sender, mode: str = "full", at: int = 0, go: str | None = None,
                timeout: float = 180, down: str | None = None) -> tuple[int, dict]:
        s = self.seed()
        self.tried.append(f"seed{s}")
        sender.ask(seed=s, mode=mode, at=at, go=go, down=down)
        return s, (sender.next_event(timeout) if mode not in ("hold", "late", "slow", "pause") else {})

    def count(self, row: dict, event: dict) -> None:
        row["attempted"] += 1
        ev = event.get("event")
        if ev == "done":
            row["committed"] += 1
            self.done.append(f"seed{event['seed']}")
        else:
            row["refused"] += 1
            error = " | ".join(ln.strip() for ln in event.get("error", "").splitlines()[:2])
            self.log(f"  {row['fault']}: {ev}: {event.get('kind', '')} {error[:200]}")
            if ev in ("timeout", "exited"):
                self.failures.append(f"{row['fault']}: sender gave no result: {event}")

    def wait_not_open(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if all(state_of(u)["state"] != "open" for u in self.urls):
                    return
            except Exception:  # noqa: BLE001
                return  # a dead engine: the check finds it
            time.sleep(0.2)

    # -- the invariant --------------------------------------------------------------------------------
    def check(self, row: dict, update_no: int) -> bool:
        """Each engine serves exactly its reported version's bytes, or is torn and says so. Returns
        whether any engine is torn (the next update then heals)."""
        self.wait_not_open()
        torn_any = False
        for i in range(len(self.engines)):
            if i in self.skipped:  # left out of this update (down, removed): it keeps what it had
                continue
            self.allowed[i] = {self.done[-1]} if self.done else self.allowed[i] | set(self.tried)
        for i, e in enumerate(self.engines):
            where = f"update {update_no} ({row['fault']}), engine {e.name}"
            try:
                st = state_of(e.url)
                status, body = health_of(e.url)
                version = SglangEngine(e.url, timeout=30).weight_version()
            except Exception as err:  # noqa: BLE001
                self.log(f"  {where}: unreachable ({err}); restarting")
                row["restarts"] += 1
                e.restart()
                self.initial[i] = SglangEngine(e.url, timeout=30).weight_version()
                self.allowed[i] = {self.initial[i]}
                for s in [self.main, *self.spares]:  # connected to the old ranks: new senders
                    if s is not None:
                        s.close()
                self.main, self.spares = None, []
                continue
            said_torn = isinstance(body, dict) and body.get("status") == p.TORN
            if self.a.engine_kind == "sglang":  # sglang's /health is sglang's own (docs/sglang.md): never torn
                said_torn = st["state"] == p.TORN
            if st["state"] == p.TORN:
                torn_any = True
                row["torn"] += 1
                if not said_torn:
                    row["wrong"] += 1
                    self.failures.append(f"{where}: torn but /health says {status} {body}")
                continue
            if said_torn:
                row["wrong"] += 1
                self.failures.append(f"{where}: /health torn but state {st}")
                continue
            if st["state"] != "none":
                row["wrong"] += 1
                self.failures.append(f"{where}: session still {st} after the update")
                continue
            if version not in self.allowed[i]:
                row["wrong"] += 1
                self.failures.append(f"{where}: serves {version}, not the last committed version "
                                     f"({' or '.join(sorted(self.allowed[i]))})")
                continue
            self.allowed[i] = {version}  # what it serves now is its last committed version
            if version == self.initial[i] and not version.startswith("seed"):
                continue  # the engine's start-up weights, before any commit
            equal, why = self.bytes_equal(e, int(version[4:]))
            if not equal:
                row["wrong"] += 1
                self.failures.append(f"{where}: reports {version} but its bytes differ: {why[:300]}")
        return torn_any

    def bytes_equal(self, engine, seed: int) -> tuple[bool, str]:
        """Whether ``engine`` holds exactly ``random_checkpoint(specs, seed)`` on every rank."""
        if self.sglang_bytes is not None:
            return self.sglang_bytes.check(engine, seed)
        result = check_weights_equal(engine.url, hf_seed=seed)
        return bool(result["success"]), str(result.get("message", ""))

    # -- the faults -----------------------------------------------------------------------------------
    def fault_none(self, row: dict) -> None:
        _, ev = self.run_one(self.main_sender())
        self.count(row, ev)

    def _writing(self, row: dict, sender: Sender, mode: str) -> tuple[int, str, bool]:
        go = self.go_file()
        open(go, "w").close()
        at = self.rng.randrange(self.tensors - 1)
        s, _ = self.run_one(sender, mode, at=at, go=go)
        ev = sender.next_event(180)
        if ev.get("event") != "writing":  # failed or refused before it wrote
            self.count(row, ev)
            return s, go, False
        return s, go, True

    def fault_kill(self, row: dict) -> None:
        victim = self.spare()
        try:
            _, _, writing = self._writing(row, victim, "hold")
            if writing:
                time.sleep(self.rng.uniform(0, 0.5))
                victim.signal(signal.SIGKILL)
                self.count(row, {"event": "killed"})
        finally:
            victim.close()

    def _until_torn(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(state_of(u)["state"] != "open" for u in self.urls):
                return
            time.sleep(0.2)

    def fault_expiry(self, row: dict) -> None:
        victim = self.spare()
        try:
            _, _, writing = self._writing(row, victim, "hold")
            if writing:
                victim.signal(signal.SIGSTOP)
                self._until_torn()
                time.sleep(self.rng.uniform(0, 1.0))
                victim.signal(signal.SIGKILL)
                self.count(row, {"event": "expired"})
        finally:
            victim.close()

    def fault_late(self, row: dict) -> None:
        late = self.spare()
        try:
            _, go, writing = self._writing(row, late, "late")
            if not writing:
                return
            late.signal(signal.SIGSTOP)
            self._until_torn()
            _, ev = self.run_one(self.main_sender())  # another controller: a complete update
            self.count(row, ev)
            open(go + ".resume", "w").close()
            late.signal(signal.SIGCONT)  # the late sender pushes the rest of its update
            ev = late.next_event(180)
            self.count(row, ev)
            self.done = self.done[:1]  # the healer's commit is the last committed one
            stop = late_stop(ev)
            self.late["resumed"] += 1
            self.late[stop] += 1
            for code in (ev.get("codes") or {}).values():
                self.late_codes[code] = self.late_codes.get(code, 0) + 1
            first = next((ln.strip() for ln in ev.get("error", "").splitlines()[1:] if ln.strip()), ev.get("error", ""))
            self.log(f"  late sender: {ev.get('event')}, stopped by: {stop}, codes {ev.get('codes')}: {first[:240]}")
            if self.a.unfenced and stop == "sender":
                self.failures.append(f"late: --unfenced, yet the sender's own fence stopped the late sender: {ev}")
            if ev.get("event") == "done":
                self.failures.append(f"late: the late sender's update committed: {ev}")
            time.sleep(1.0)  # anything still on the wire has landed by now
        finally:
            late.close()

    def fault_concurrent(self, row: dict) -> None:
        a, b = self.main_sender(), self.spare()
        try:
            go = self.go_file()
            self.run_one(a, "slow", go=go)
            self.run_one(b, "slow", go=go)
            open(go, "w").close()  # both controllers start at once
            evs = [a.next_event(180), b.next_event(180)]
            for ev in evs:
                self.count(row, ev)
            if sum(ev.get("event") == "done" for ev in evs) > 1:
                self.failures.append(f"concurrent: both controllers committed: {evs}")
        finally:
            b.close()

    def fault_nan(self, row: dict) -> None:
        at = 0 if self.rng.random() < 0.5 else self.rng.randrange(self.tensors)
        before = [state_of(u) for u in self.urls]
        _, ev = self.run_one(self.main_sender(), "nan", at=at)
        self.count(row, ev)
        if ev.get("event") != "failed" or ev.get("kind") != "NonFiniteTensor":
            self.failures.append(f"nan: not refused as NonFiniteTensor: {ev}")
        if at == 0 and [state_of(u) for u in self.urls] != before:
            self.failures.append("nan: a NaN in the first tensor changed an engine's session state")

    def fault_engine_stop(self, row: dict) -> None:
        e = self.rng.choice(self.engines)
        rank = self.rng.randrange(e.world)
        pid = e.pids[rank]
        go = self.go_file()
        s = self.seed()
        self.tried.append(f"seed{s}")
        self.main_sender().ask(seed=s, mode="full", at=0, go=go)
        open(go, "w").close()
        time.sleep(self.rng.uniform(0, 0.5))
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(1.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        self.count(row, self.main_sender().next_event(180))

    # -- churn: the engine set changes under the long-lived main sender ---------------------------------
    def _restarted(self, i: int) -> None:
        """Engine ``i`` started again at its address: it serves its start-up weights (no sender replaced)."""
        self.engines[i].restart()
        self.initial[i] = SglangEngine(self.engines[i].url, timeout=30).weight_version()
        self.allowed[i] = {self.initial[i]}
        self.churn["restarted"] += 1

    def _expect_skipped(self, ev: dict, i: int) -> None:
        name = SglangEngine(self.engines[i].url).name
        if ev.get("event") == "done":
            if ev.get("skipped") != [name]:
                self.churn["missed"] += 1
                self.failures.append(f"{ev}: engine {name} should have been the one skipped")
            else:
                self.churn["skipped"] += 1

    def fault_restart(self, row: dict) -> None:
        sender = self.main_sender()
        self._restarted(self.rng.randrange(len(self.engines)))
        _, ev = self.run_one(sender)
        self.count(row, ev)
        if ev.get("event") != "done":
            self.failures.append(f"restart: the main sender's update after an engine restart did not commit: {ev}")

    def fault_down(self, row: dict) -> None:
        sender = self.main_sender()
        i = self.rng.randrange(len(self.engines))
        self.engines[i].kill()
        self.skipped = {i}
        _, ev = self.run_one(sender, down="skip")
        self.count(row, ev)
        self._expect_skipped(ev, i)
        self._restarted(i)

    def fault_kill_mid(self, row: dict) -> None:
        sender = self.main_sender()
        i = self.rng.randrange(len(self.engines))
        go = self.go_file()
        open(go, "w").close()
        self.run_one(sender, "pause", at=self.rng.randrange(self.tensors - 1), go=go, down="skip")
        ev = sender.next_event(180)
        if ev.get("event") == "writing":
            self.engines[i].kill()
            self.skipped = {i}
            open(go + ".resume", "w").close()
            ev = sender.next_event(240)
            self._expect_skipped(ev, i)
        self.count(row, ev)
        if i in self.skipped:
            self._restarted(i)

    def fault_leave_join(self, row: dict) -> None:
        sender = self.main_sender()
        i = self.rng.randrange(len(self.engines))
        url = SglangEngine(self.engines[i].url).base_url
        sender.ask(cmd="remove", url=url)
        if sender.next_event(120).get("event") != "ok":
            self.failures.append(f"leave_join: removing {url} failed")
            return
        self.skipped = {i}
        _, ev = self.run_one(sender)
        self.count(row, ev)
        sender.ask(cmd="add", url=url)
        back = sender.next_event(300)
        if back.get("event") != "ok":
            self.failures.append(f"leave_join: adding {url} back failed: {back}")
        else:
            self.churn["rejoined"] += 1

    # -- the run --------------------------------------------------------------------------------------
    def run(self) -> None:
        t0 = time.monotonic()
        layouts = self.a.engines.split(",")
        env = {}
        if self.a.unrevoked:  # the engine processes only (the senders never see it)
            env = {"CHAOS_UNREVOKED": "1", "PYTHONPATH": os.pathsep.join(
                [UNREVOKED_DIR, PACKAGE_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])}
        if self.a.engine_kind == "sglang":
            self.engines = [SglangChaosEngine(self.cfg, layout, f"chaos{i}", self.tmp, env).start()
                            for i, layout in enumerate(layouts)]
            for e in self.engines:
                e.wait()
        else:
            if len(set(layouts)) != 1:
                raise SystemExit(f"--engines {self.a.engines}: our receiver's engines here share one layout")
            self.engines = start_engines(self.cfg, layouts[0], count=len(layouts), transport=self.a.transport,
                                         name_prefix="chaos", env=env or None)
        self.initial = [SglangEngine(u, timeout=30).weight_version() for u in self.urls]
        self.allowed = [{v} for v in self.initial]
        self.log(f"engines up in {time.monotonic() - t0:.1f}s: {self.urls} ({self.a.engine_kind}, {layouts}; "
                 f"start-up versions {self.initial})")
        self.tensors = self.main_sender().ready["tensors"]
        heal = False
        chosen = self.a.faults.split(",")
        kinds = [f for f in FAULTS if f in chosen]
        weights = [self.a.weights.get(f, w) for f, w in zip(FAULTS, WEIGHTS) if f in chosen]
        for n in range(1, self.a.updates + 1):
            fault = "none" if heal else self.rng.choices(kinds, weights)[0]
            row = self.rows[fault]
            row["updates"] += 1
            t = time.monotonic()
            self.tried, self.done, self.skipped = [], [], set()
            getattr(self, f"fault_{fault}")(row)
            heal = self.check(row, n)
            versions = []
            for u in self.urls:
                try:
                    versions.append(f"{SglangEngine(u, timeout=10).weight_version()}/{state_of(u)['state']}")
                except Exception:  # noqa: BLE001
                    versions.append("?")
            self.log(f"update {n}/{self.a.updates}: {fault:<11} {time.monotonic() - t:5.1f}s  engines {versions}"
                     f"  wrong so far {sum(r['wrong'] for r in self.rows.values())}")

    def close(self) -> None:
        for s in [self.main, *self.spares]:
            if s is not None:
                s.close()
        for e in self.engines:
            try:
                pids = list(e.pids.values())
            except Exception:  # noqa: BLE001 - a server already gone
                pids = []
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGCONT)
                except OSError:
                    pass
            e.close()


COLUMNS = [("fault", "fault", ""), ("updates", "updates", "d"), ("attempted", "attempted", "d"),
           ("committed", "committed", "d"), ("refused", "refused/failed", "d"), ("torn", "torn after", "d"),
           ("wrong", "wrong bytes served", "d"), ("restarts", "engine restarts", "d")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates", type=int, default=200)
    ap.add_argument("--transport", default="mooncake", choices=["mooncake", "nixl"])
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--faults", default=",".join(FAULTS), help="the fault kinds drawn (comma-separated)")
    ap.add_argument("--unfenced", action="store_true",
                    help="the engine's revocation alone: every sender-side lease check is off in the sender processes "
                         "(PipelinedWriter.fence a no-op); 0 wrong bytes is the expected result")
    ap.add_argument("--unrevoked", action="store_true",
                    help="self-check of the harness (with --unfenced): the engines' revocation is off too "
                         "(chaos_unrevoked/sitecustomize.py in the engine processes); late faults must then "
                         "report wrong bytes")
    ap.add_argument("--engine-kind", default="receiver", choices=["receiver", "sglang"],
                    help="our receiver's rank processes, or real sglang 0.5.23 CPU servers with the plugin (mooncake)")
    ap.add_argument("--engines", default=None,
                    help="the engines' layouts, comma-separated (default: tp=2,tp=2 for the receiver, tp=1,tp=2 for "
                         "sglang)")
    ap.add_argument("--weights", default="",
                    help="the draw's weights of some faults, e.g. late=4 (default: " +
                         ",".join(f"{f}={w}" for f, w in zip(FAULTS, WEIGHTS)) + ")")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    a = ap.parse_args()
    unknown = set(a.faults.split(",")) - set(FAULTS)
    if unknown:
        ap.error(f"unknown fault(s) {sorted(unknown)}; known: {FAULTS}")
    try:
        a.weights = {f: float(w) for f, w in (kv.split("=") for kv in a.weights.split(",") if kv)}
    except ValueError:
        ap.error(f"--weights {a.weights!r}: fault=weight, comma-separated")
    if set(a.weights) - set(FAULTS):
        ap.error(f"--weights: unknown fault(s) {sorted(set(a.weights) - set(FAULTS))}")
    if a.engine_kind == "sglang" and a.transport != "mooncake":
        ap.error("--engine-kind sglang: sglang 0.5.23 publishes a rank's weights as a Mooncake session only")
    if a.unrevoked and not a.unfenced:
        ap.error("--unrevoked is the harness's self-check of --unfenced: give both")
    if a.engines is None:
        a.engines = "tp=1,tp=2" if a.engine_kind == "sglang" else "tp=2,tp=2"
    if a.unfenced:
        os.environ["CHAOS_UNFENCED"] = "1"
    if a.seed is None:
        a.seed = random.SystemRandom().randrange(1 << 31)
    print(f"# chaos seed {a.seed} (--seed {a.seed} replays the draws)", file=sys.stderr, flush=True)
    chaos = Chaos(a)
    t0 = time.monotonic()
    try:
        chaos.run()
    finally:
        chaos.close()
    rows = [r for r in chaos.rows.values() if r["updates"]]
    total = {"fault": "total", **{k: sum(r[k] for r in rows) for k in rows[0] if k != "fault"}} if rows else None
    rows_out = rows + ([total] if total else [])
    wrong = total["wrong"] if total else 0
    late = chaos.late
    codes = ", ".join(f"{k} x{n}" for k, n in sorted(chaos.late_codes.items())) or "none"
    weighted = "".join(f", weight {f}={w:g}" for f, w in a.weights.items())
    footer = (f"# seed {a.seed}, {a.updates} updates{weighted}, engines {a.engine_kind} {a.engines}, transport {a.transport}, "
              f"lease {LEASE}s, "
              + ("UNFENCED (no sender-side lease check), " if a.unfenced else "")
              + ("UNREVOKED (self-check: no engine revocation either), " if a.unrevoked else "") +
              f"{time.monotonic() - t0:.0f}s\n"
              f"# late senders resumed: {late['resumed']}; stopped by the engine (a post failed: the old epoch "
              f"revoked): {late['engine']}; by the sender's own lease fence (FENCED): {late['sender']}; "
              f"no write refused: {late['none']}; committed: {late['committed']}\n"
              f"# the late senders' failed writes (engine ranks, by native code): {codes}\n"
              f"# spare senders whose connect failed (raced a takeover), replaced: {chaos.spare_failures}\n"
              f"# churn: engines restarted at the same address {chaos.churn['restarted']}, skipped as named "
              f"{chaos.churn['skipped']} (not as named: {chaos.churn['missed']}), removed and added back "
              f"{chaos.churn['rejoined']}\n"
              f"# attempted: updates begun by any controller (a late or concurrent fault has two); "
              f"torn after: engines found paused and torn after the update (healed by the next)\n"
              + ("# OK: 0 wrong bytes served" if not chaos.failures else
                 "# FAILED:\n" + "\n".join(f"#   {f}" for f in chaos.failures)))
    extra = {"seed": a.seed, "transport": a.transport, "updates": a.updates, "faults": a.faults, "weights": a.weights,
             "unfenced": a.unfenced,
             "unrevoked": a.unrevoked, "engine_kind": a.engine_kind, "engines": a.engines, "late": late,
             "late_codes": chaos.late_codes, "spare_failures": chaos.spare_failures, "churn": chaos.churn,
             "seconds": round(time.monotonic() - t0, 1), "failures": chaos.failures}
    emit(f"p2pweights chaos: {a.engine_kind} engines {a.engines} (tiny qwen3), {a.transport}", COLUMNS, rows_out,
         as_json=a.json,
         footer=footer, extra=extra)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows_out, **extra}, f, indent=2)
    return 0 if not chaos.failures and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
