"""A chaos run: many updates on two engines, faults at random points, the invariant after each (issue 23).

    PYTHONPATH=python python3 benchmarks/chaos.py [--updates 200] [--transport mooncake|nixl] [--seed N]
                                                  [--faults none,kill,...] [--unfenced] [--json] [--out FILE]

Two engines (tiny qwen3, tp=2) and sender processes (each its own controller), all with
``P2PW_SESSION_LEASE=2``. Each update draws one fault from a seeded RNG (the seed is printed;
``--seed`` replays the draws, not the timing):

  none          a complete update
  kill          the sender is SIGKILLed after its writes began (at a random tensor)
  late          the sender is SIGSTOPped after its writes began, held past the engines' lease; another
                controller commits a complete update; the late sender is SIGCONTed and pushes the rest:
                not one of its bytes may land (the sender's fence stops posts after its lease)
  concurrent    two controllers start at once: at most one commits, the other is refused
  nan           a pushed tensor holds NaN with check_finite=True: refused (before the pause when first)
  expiry        the sender is SIGSTOPped after its writes began, left past the lease, then SIGKILLed
  engine_stop   a rank of one engine is SIGSTOPped for 1 s (within its watchdog's ~2 s) mid-update

After every update, each engine must either report version ``seedN`` (or ``default`` before any
commit) and hold exactly the bytes of ``random_checkpoint(specs, N)`` with no session open, or be
torn: ``/health`` says torn and the engine refuses to continue. Anything else is a wrong-bytes count
(must be 0). An engine that dies is restarted (counted). After a torn engine the next update is a
complete one (it heals it).

``--unfenced`` is the harness's self-check: the senders' lease fence is monkeypatched off in the
sender processes, and a run with late faults must then report wrong bytes served.
"""
from __future__ import annotations

import argparse
import json
import os
import random
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from replica_configs import write_config  # noqa: E402

FAULTS = ["none", "kill", "late", "concurrent", "nan", "expiry", "engine_stop"]
WEIGHTS = [4, 2, 2, 1, 1, 1, 1]

# One sender process: a loop of updates asked on stdin, one JSON line each; events on stdout.
CHILD = textwrap.dedent('''
    import json, os, sys, time
    import torch
    from p2pweights.errors import P2PWeightsError, SessionConflict
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
    from p2pweights.sender import WeightSender

    cfg, transport = sys.argv[1:3]
    if os.environ.get("CHAOS_UNFENCED") == "1":  # --unfenced: the harness's self-check
        from p2pweights.sender.update import Update
        Update._fence_writes = lambda self, engine, deadline: None
    urls = sys.argv[3:]
    def say(**kw):
        print(json.dumps(kw), flush=True)
    sender = WeightSender(cfg, transport=transport, buffer_size=1 << 20)
    sender.connect(urls)
    specs = checkpoint_tensors(cfg)
    say(event="ready", pid=os.getpid(), tensors=len(list(random_checkpoint(specs, 0))))
    for line in sys.stdin:
        job = json.loads(line)
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
            with sender.update(f"seed{seed}", check_finite=(mode == "nan") or None, force=True) as update:
                for i, (name, t) in enumerate(items):
                    update.push(name, t)
                    if mode == "slow" and i == 0:
                        time.sleep(2.0)  # holds its session: the other controller certainly meets it
                    if mode in ("hold", "late") and i == at:
                        update.pipeline.drain()  # what is placed goes out now: its writes begin
                        if mode == "late":  # stopped between posts, not inside one (docs/security.md)
                            time.sleep(1.0)
                        say(event="writing", slots=update.times.slots)
                        if mode == "hold":
                            time.sleep(600)  # until stopped / killed
                        while not os.path.exists(go + ".resume"):
                            time.sleep(0.005)
            say(event="done", seed=seed)
        except SessionConflict as e:
            say(event="refused", error=str(e)[:400], engine=e.engine)
        except P2PWeightsError as e:
            say(event="failed", error=str(e)[:400], kind=type(e).__name__)
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
        self.cfg = write_config("qwen3", self.tmp)
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
        self.late_fenced = [0, 0]  # late senders whose error names the lease / all late senders resumed

    def log(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    # -- processes ------------------------------------------------------------------------------------
    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    def spare(self) -> Sender:
        """A fresh sender process (spawned ahead, one always warming)."""
        while len(self.spares) < 2:
            self.spares.append(Sender(self.cfg, self.urls, self.a.transport, self.sender_log))
        s = self.spares.pop(0).wait_ready()
        self.spares.append(Sender(self.cfg, self.urls, self.a.transport, self.sender_log))
        return s

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
                timeout: float = 180) -> tuple[int, dict]:
        s = self.seed()
        self.tried.append(f"seed{s}")
        sender.ask(seed=s, mode=mode, at=at, go=go)
        return s, (sender.next_event(timeout) if mode not in ("hold", "late", "slow") else {})

    def count(self, row: dict, event: dict) -> None:
        row["attempted"] += 1
        ev = event.get("event")
        if ev == "done":
            row["committed"] += 1
            self.done.append(f"seed{event['seed']}")
        else:
            row["refused"] += 1
            self.log(f"  {row['fault']}: {ev}: {event.get('kind', '')} {event.get('error', '')[:160]}")
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
                self.allowed[i] = {"default"}
                for s in [self.main, *self.spares]:  # connected to the old ranks: new senders
                    if s is not None:
                        s.close()
                self.main, self.spares = None, []
                continue
            said_torn = isinstance(body, dict) and body.get("status") == p.TORN
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
            if version == "default":
                continue  # the engine's start-up weights, before any commit
            result = check_weights_equal(e.url, hf_seed=int(version[4:]))
            if not result["success"]:
                row["wrong"] += 1
                self.failures.append(f"{where}: reports {version} but its bytes differ: {result['message'][:300]}")
        return torn_any

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

    def _until_torn(self, timeout: float = 20.0) -> None:
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
            self.late_fenced[1] += 1
            self.late_fenced[0] += "lease" in ev.get("error", "")
            self.log(f"  late sender: {ev.get('event')}: {ev.get('error', '')[:200]}")
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

    # -- the run --------------------------------------------------------------------------------------
    def run(self) -> None:
        t0 = time.monotonic()
        self.engines = start_engines(self.cfg, "tp=2", count=2, transport=self.a.transport, name_prefix="chaos")
        self.allowed = [{"default"} for _ in self.engines]
        self.log(f"engines up in {time.monotonic() - t0:.1f}s: {self.urls}")
        self.tensors = self.main_sender().ready["tensors"]
        heal = False
        chosen = self.a.faults.split(",")
        kinds = [f for f in FAULTS if f in chosen]
        weights = [w for f, w in zip(FAULTS, WEIGHTS) if f in chosen]
        for n in range(1, self.a.updates + 1):
            fault = "none" if heal else self.rng.choices(kinds, weights)[0]
            row = self.rows[fault]
            row["updates"] += 1
            t = time.monotonic()
            self.tried, self.done = [], []
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
            for pid in e.pids.values():
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
                    help="self-check of the harness: the senders' lease fence is switched off (monkeypatched in the "
                         "sender processes); a run with late faults must then report wrong bytes")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    a = ap.parse_args()
    unknown = set(a.faults.split(",")) - set(FAULTS)
    if unknown:
        ap.error(f"unknown fault(s) {sorted(unknown)}; known: {FAULTS}")
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
    footer = (f"# seed {a.seed}, {a.updates} updates, transport {a.transport}, lease {LEASE}s, "
              + ("UNFENCED (self-check), " if a.unfenced else "") +
              f"{time.monotonic() - t0:.0f}s\n"
              f"# late senders resumed: {chaos.late_fenced[1]}, failed naming the lease (fenced): "
              f"{chaos.late_fenced[0]}\n"
              f"# attempted: updates begun by any controller (a late or concurrent fault has two); "
              f"torn after: engines found paused and torn after the update (healed by the next)\n"
              + ("# OK: 0 wrong bytes served" if not chaos.failures else
                 "# FAILED:\n" + "\n".join(f"#   {f}" for f in chaos.failures)))
    extra = {"seed": a.seed, "transport": a.transport, "updates": a.updates, "faults": a.faults, "unfenced": a.unfenced,
             "failures": chaos.failures}
    emit(f"p2pweights chaos: 2 engines x tp=2 (tiny qwen3), {a.transport}", COLUMNS, rows_out, as_json=a.json,
         footer=footer, extra=extra)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"rows": rows_out, **extra}, f, indent=2)
    return 0 if not chaos.failures and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
