"""Engines joining while updates to the others go on, and the engine set each update writes
(docs/sender.md, "The engine set").

``add_engines(wait=False)`` starts a :class:`Join`: on a thread it reads every joining engine
(``/server_info``, layout, build, transport), builds the replicas of the engine ranks this sender
would write under the new plan (the slow part, cached process-wide) and fetches and checks those
ranks' publications. Nothing is attached there: the writer belongs to the updates. At each
``update()`` :func:`update_set` decides what that update writes:

1. with a group, every sender's view is gathered (one small all-gather): the engine lists must be
   the same, in the same order; a join is attached only once every sender has it ready, so all
   senders plan the same set;
2. the joins ready everywhere are attached (``engine_set.apply_engine_set``, incremental);
3. under ``on_engine_down="skip"`` the controller asks every engine its version; the engines that
   do not answer (``EngineUnreachable``) are left out of this update and reported in
   ``report.engines_skipped``; the sender forgets their last commit, so that they are written in
   full when back (their base is older than the sender's).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import replace
from typing import Any, Sequence

from ..control import SglangEngine
from ..control.engine_calls import call_engines
from ..errors import EngineError, EngineUnreachable, P2PWeightsError, SenderGroupError, UpdateFailed
from .connect_report import ConnectPhases
from .engine_set import DOWN, FAILED, JOINING, READY, EngineMember, apply_engine_set, fetch_publication, plan_of, survey_engines
from .group import SenderStatus

logger = logging.getLogger(__name__)


class Join:
    """The joining engines' preparation on a thread (module docstring)."""

    def __init__(self, sender: Any, members: Sequence[EngineMember]):
        self.sender, self.members = sender, list(members)
        self.phases = ConnectPhases(sender.replicas)
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="p2pw-join", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            prepare_join(self.sender, self.members, self.phases)
        except BaseException as e:  # noqa: BLE001 - the join failed: its engines say why (state failed)
            self.error = e
            for m in self.members:
                m.state, m.reason = FAILED, f"{type(e).__name__}: {e}"
            logger.error("joining %s failed: %s", ", ".join(m.name for m in self.members), e)
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)


def prepare_join(sender: Any, members: Sequence[EngineMember], phases: Any = None) -> None:
    """Read and check the joining engines, build their ranks' replicas, fetch and check the
    publications this sender will write (kept on each member for the attach)."""
    surveys, transport, _ = survey_engines(sender, [m.client for m in members], phases)
    if sender.transport is not None and transport != sender.transport:
        raise EngineError(f"engine {surveys[0].client.name} takes writes over {transport}; this sender writes over "
                          f"{sender.transport}: one sender writes one transport", engine=surveys[0].client.name,
                          hint="start the engine with the sender's transport, or use another sender")
    for m, s in zip(members, surveys):
        m.survey, m.instance = s, s.instance
    known = [m.survey for m in sender._members.values() if m.state in (READY, DOWN) and m.survey is not None]
    everyone = known + list(surveys)
    joining = {s.client.name for s in surveys}
    for entry in plan_of(sender, everyone):
        for e in entry.engines:
            s = everyone[e]
            if s.client.name in joining:
                p = sender._prepare(s.layout, entry.engine_rank)  # the replica, cached for the attach
                by_name = {m.name: m for m in members}
                by_name[s.client.name].publications[p.rank] = fetch_publication(sender, p, s, transport, phases)


def update_set(sender: Any, on_engine_down: str) -> tuple[list[Any], list[SglangEngine], dict[str, str]]:
    """The ranks and engines this update writes, and the engines it skips (module docstring)."""
    members = sender._members
    ready_joins = [n for n, m in members.items() if m.state == JOINING and sender._join is not None
                   and sender._join.done() and m.survey is not None]
    down: dict[str, str] = {}
    if on_engine_down == "skip" and sender.group.controller:
        attached = [m.client for m in members.values() if m.state in (READY, DOWN)]
        calls = call_engines(attached, "weight_version")
        down = {n: f"{type(e).__name__}: {e}" for n, e in calls.errors.items() if isinstance(e, EngineUnreachable)}
    if sender.group.size > 1:
        ready_joins, down = _agree(sender, ready_joins, down)
    if ready_joins:
        surveys = [m.survey for m in members.values() if m.state in (READY, DOWN) or m.name in ready_joins]
        apply_engine_set(sender, surveys, sender.transport, sender.transport_why, incremental=True)
        if sender.recorder is None and sender.settings.copy_plans == "background":
            sender._start_recorder()
        logger.info("engines joined: %s (written in full by this update)", ", ".join(ready_joins))
    for name, m in members.items():
        if name in down:
            m.state, m.reason, m.skipped = DOWN, down[name], m.skipped + 1
            if sender._bases is not None:  # it keeps an older commit than the sender's base: full when back
                sender._bases.identities.pop(name, None)
        elif m.state == DOWN:
            m.state, m.reason = READY, ""
    if not down:
        return sender._ranks, sender._engines, {}
    if on_engine_down != "skip":
        raise ValueError(f"on_engine_down must be one of fail, skip, got {on_engine_down!r}")
    engines = [e for e in sender._engines if e.name not in down]
    if not engines:
        raise UpdateFailed(down, what="every engine is down; nothing to update")
    logger.warning("update skips %d engine(s) that do not answer: %s", len(down),
                   "; ".join(f"{n}: {why}" for n, why in down.items()))
    ranks = [replace(p, targets=[t for t in p.targets if t.engine.name not in down]) for p in sender._ranks]
    return ranks, engines, down


def _agree(sender: Any, ready_joins: list[str], down: dict[str, str]) -> tuple[list[str], dict[str, str]]:
    """Every sender's engine list, joins ready and (the controller's) engines down, gathered: the
    lists must agree; a join is attached where every sender has it ready."""
    me = sender.group.index
    names = [n for n, m in sender._members.items() if m.state != FAILED]
    statuses = sender.group.gather(SenderStatus(me, deltas={"engines": names, "ready": ready_joins, "down": down}))
    views = {s.sender: s.deltas for s in statuses}
    for other, view in views.items():
        if view.get("engines") != names:
            raise SenderGroupError(f"sender {me} has engines {names}, sender {other} has {view.get('engines')}: "
                                   f"every sender of a group must add and remove the same engines, in the same order",
                                   hint="call add_engines / remove_engines with the same list on every sender")
    ready = [n for n in ready_joins if all(n in v.get("ready", ()) for v in views.values())]
    return ready, dict(views[0].get("down", {})) if 0 in views else down


def check_engine_down(value: Any) -> str:
    if value not in ("fail", "skip"):
        raise P2PWeightsError(f"on_engine_down must be 'fail' (an engine down fails the update, named) or 'skip' "
                              f"(commit the others; report.engines_skipped names it), got {value!r}")
    return value
