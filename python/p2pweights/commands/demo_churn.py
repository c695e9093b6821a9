"""``p2pweights demo --churn``: the engine set changes between steps while one sender keeps updating
(docs/sender.md, "The engine set"). E engines of T ranks start as receiver processes, plus one that
joins later; one in-process sender (no group) writes version k of a changed family at step k (1% of
the elements changed per step unless ``--changed-fraction`` says otherwise), so the engines kept go
on as deltas while each engine that joins, restarts or comes back is written in full. The events,
one per step after the first:

  restart   engine0 is restarted at its address (another process: re-planned at the begin)
  join      the spare engine joins (add_engines(wait=False): checked and planned on a thread)
  down      engine1 is killed; the update skips it (on_engine_down="skip")
  back      engine1 is started again at its address: written in full
  leave     the spare engine leaves (remove_engines): it keeps its last version

Every engine written is checked byte for byte after each step; an engine left out keeps its bytes.
One row per engine and step: its state, what was written to it (full or delta, bytes) and equal.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ..settings import format_size

EVENTS = ("start", "restart", "join", "down", "back", "leave")


@dataclass
class ChurnRow:
    step: int
    event: str
    engine: str
    state: str  # the sender's view after the step (engine_set.py)
    written: str  # "full", "delta", "skipped: why", "not in the set"
    bytes: int
    bytes_written: int
    version: str  # what the engine serves after the step
    equal: bool | None
    seconds: float  # the step's update (report.seconds)


def run_churn_demo(model: str, *, engines: int = 2, engine: str = "tp=2", transport: str = "mooncake",
                   changed_fraction: float | None = None, check: bool = True, overrides: dict | None = None,
                   progress: Callable[[str], None] = print) -> list[ChurnRow]:
    from ..control import SglangEngine
    from ..models.checkpoint import checkpoint_tensors, random_checkpoint
    from ..receiver import LocalEngine, check_weights_equal, start_together
    from ..sender import WeightSender

    if engines < 2:
        raise SystemExit("--churn: needs --engines 2 or more (engine1 goes down while engine0 is updated)")
    fraction = 0.01 if changed_fraction is None else changed_fraction
    t0 = time.perf_counter()
    progress(f"starting {engines} engine(s) x {engine} and one that joins later ({transport}) ...")
    running = [LocalEngine(model, engine, name=f"engine{i}", transport=transport) for i in range(engines + 1)]
    spare = running[-1]
    rows: list[ChurnRow] = []
    sender = None
    try:
        start_together(running)
        progress(f"engines up in {time.perf_counter() - t0:.1f} s")
        specs = checkpoint_tensors(model)
        sender = WeightSender(model, transport=transport, **(overrides or {}))
        sender.connect([SglangEngine(e.url, name=e.name) for e in running[:-1]])
        for step, event in enumerate(EVENTS, start=1):
            down = None
            if event == "restart":
                running[0].restart()
            elif event == "join":
                sender.add_engines([SglangEngine(spare.url, name=spare.name)], wait=False)
                sender._join.wait()
            elif event == "down":
                running[1].kill()
                down = "skip"
            elif event == "back":
                running[1].restart()
            elif event == "leave":
                sender.remove_engines([spare.name])
            tensors = list(random_checkpoint(specs, 0, changed=(fraction, step)))
            with sender.update(f"churn{step}", on_engine_down=down or "fail") as u:
                u.push_many(tensors)
            rows += _rows(step, event, u.report, sender, running, check, fraction, check_weights_equal)
            for r in (r for r in rows if r.step == step):
                progress(row_text(r))
    finally:
        if sender is not None:
            sender.close()
        for e in running:
            e.close()
    return rows


def _rows(step: int, event: str, report: Any, sender: Any, running: list, check: bool, fraction: float,
          check_weights_equal: Callable) -> list[ChurnRow]:
    from ..control import SglangEngine

    states = {m.name: m.state for m in sender.engines}
    by_engine: dict[str, list] = {}
    for e in report.engines:
        by_engine.setdefault(e.engine, []).append(e)
    out = []
    for e in running:
        ranks = by_engine.get(e.name, [])
        if ranks:
            written = "delta" if all(r.delta for r in ranks) else "full"
        else:
            written = f"skipped: {report.engines_skipped[e.name]}" if e.name in report.engines_skipped else "not in the set"
        try:
            version = SglangEngine(e.url, timeout=30).weight_version()
        except Exception:  # noqa: BLE001 - a dead engine (down): no version to read
            version = "-"
        equal = None
        if check and ranks:
            equal = bool(check_weights_equal(e.url, hf_seed=0, changed_fraction=fraction, changed_steps=step)["success"])
        out.append(ChurnRow(step, event, e.name, states.get(e.name, "-"), written, sum(r.bytes for r in ranks),
                            sum(r.bytes_written for r in ranks), version, equal, report.seconds))
    return out


def row_text(r: ChurnRow) -> str:
    eq = {True: "yes", False: "NO", None: "-"}[r.equal]
    return (f"{r.step:>4}  {r.event:<8} {r.engine:<8} {r.state:<8} {r.version:<8} {format_size(r.bytes):>10}  "
            f"{format_size(r.bytes_written):>10}  {eq:>5}  {r.seconds:7.3f}  {r.written}")


HEADER = (f"{'step':>4}  {'event':<8} {'engine':<8} {'state':<8} {'version':<8} {'bytes':>10}  {'written':>10}  "
          f"{'equal':>5}  {'seconds':>7}  what")
