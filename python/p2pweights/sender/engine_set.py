"""The engines a sender writes, and how that set changes between updates (docs/sender.md, "The
engine set"): ``connect`` (a new set), ``add_engines`` / ``remove_engines`` (the set changed, the
engines kept stay attached), an engine restarted at the same address (another process: new
registrations, no base) re-planned before anything is written to it.

Each engine is an :class:`EngineMember` with a state:

- ``joining``: ``add_engines(wait=False)``: read, checked and planned on a thread (join.py), not
  written yet; the first update after that finished attaches it (with a group: once every sender
  has it ready) and writes it in full;
- ``ready``: attached, written by every update;
- ``down``: unreachable at an update's start and skipped by it (``on_engine_down="skip"``); tried
  again at every update and written in full when back (its base is not the sender's last commit);
- ``failed``: its join failed (``reason``); never written until added again.

An engine's process identity is the engine core's ``instance`` (its ``/server_info`` and every
begin answer carry it): a begin that answers another instance than the one the sender attached to
re-plans that engine's ranks (:func:`follow_engines`) before any slot is posted.
"""
from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any, Sequence

from .. import transport as transports
from ..control import SglangEngine
from ..errors import EngineError
from ..models.stages import layer_writers
from ..planner.assign import Engine as PlanEngine
from ..planner.assign import assign_engine_ranks
from ..transport.publication import EnginePublication
from ..transport.session_claims import check_sessions, session_claim
from .attach import attach_target
from .buffers import slot_size
from .delta_bases import spare_bytes
from .engine_kinds import layout_and_identity
from .prepared import PreparedRank
from .report import Progress

logger = logging.getLogger(__name__)

JOINING, READY, DOWN, FAILED = "joining", "ready", "down", "failed"
ENGINE_DOWN = ("fail", "skip")


@dataclass
class Survey:
    """One engine as connect reads it: its ``/server_info``, shard layout and build identity."""

    client: SglangEngine
    info: dict
    layout: Any
    identity: Any

    @property
    def instance(self) -> str | None:
        state = self.info.get("p2pw_weight_update") if isinstance(self.info, dict) else None
        got = state.get("instance") if isinstance(state, dict) else None
        return got if isinstance(got, str) and got else None


@dataclass
class EngineMember:
    """One engine of the sender's set (module docstring: the states)."""

    client: SglangEngine
    state: str = JOINING
    reason: str = ""  # why it is down or failed
    instance: str | None = None  # the engine process the sender attached to
    version: str | None = None  # the last version this sender committed there
    restarts: int = 0  # times the sender found another process at its address and re-planned it
    skipped: int = 0  # updates that skipped it (down)
    survey: Survey | None = None
    publications: dict[int, EnginePublication] = field(default_factory=dict)  # a join's, fetched ahead

    @property
    def name(self) -> str:
        return self.client.name

    @property
    def url(self) -> str:
        return self.client.base_url

    @property
    def base_url(self) -> str:  # the client's word for it (sender.engines listed clients before)
        return self.client.base_url

    def as_dict(self) -> dict:
        return {"name": self.name, "url": self.url, "state": self.state, "reason": self.reason,
                "instance": self.instance, "version": self.version, "restarts": self.restarts,
                "skipped": self.skipped}

    def __repr__(self) -> str:
        why = f", reason={self.reason!r}" if self.reason else ""
        return f"EngineMember({self.name!r}, {self.state}, version={self.version!r}{why})"


def survey_engines(sender: Any, clients: Sequence[SglangEngine], phases: Any = None) -> tuple[list[Survey], str, str]:
    """Every engine's ``/server_info``, transport (all the same, else WrongTransport), layout and
    identity (same build, same architecture): refused here, before any replica is built."""
    phases = phases or sender.connect_phases
    infos = [c.server_info() for c in clients]
    phases.lap("http server_info")
    transport, why = transports.transport_for_engines(sender.settings.transport,
                                                      [(c.name, info) for c, info in zip(clients, infos)])
    surveys = []
    for c, info in zip(clients, infos):
        layout, identity = layout_and_identity(c, info, sender.config)
        surveys.append(Survey(c, info, layout, identity))
    return surveys, transport, why


def plan_of(sender: Any, surveys: Sequence[Survey]) -> list[Any]:
    """This sender's entries of the planner's rank assignment over ``surveys`` (in order): with
    split="layers" its group's (each sender of a group writes its layers to all of them)."""
    engines = [PlanEngine(s.layout.world_size, s.layout.key) for s in surveys]
    if sender.split == "layers":  # its group's engine ranks (models/stages.py layer_writers)
        writers, groups = layer_writers(int(sender.config["num_hidden_layers"]), sender.pp_size, sender.pp_stage,
                                        sender.num_senders)
        return [p for p in assign_engine_ranks(groups, engines) if p.sender == sender.sender_index // writers]
    plan = assign_engine_ranks(sender.num_senders, engines)
    return [p for p in plan if p.sender == sender.sender_index]


def fetch_publication(sender: Any, p: PreparedRank, s: Survey, transport: str, phases: Any = None
                      ) -> EnginePublication:
    """Engine rank ``p.rank`` of ``s``'s publication, checked (build identity, parameters, transport)."""
    phases = phases or sender.connect_phases
    pub = EnginePublication.from_json(s.client.transfer_engine_info(p.rank))
    phases.lap("publication fetch")
    s.identity.check_rank(p.rank, pub.device_arch, pub.sglang_version)
    check_publication(p, s.client, pub, transport)
    phases.lap("publication checks")
    return pub


def check_publication(p: PreparedRank, client: SglangEngine, pub: EnginePublication, transport: str) -> None:
    """Invariant 1, both ways: the engine rank published exactly the replica's parameters, each
    with the replica's byte count, for this sender's transport; never a rank its engine refuses."""
    pub.check_not_refused(engine=client.name)  # an in-process sglang.Engine (sglang_plugin/inprocess.py)
    pub.check_transport(transport, engine=client.name)
    pub.check_regions(engine=client.name)  # no overlap, inside the registered memory
    pub.check_params({n: s.nbytes for n, s in p.replica.param_specs.items()}, engine=f"{client.name} rank {p.rank}",
                     hint=f"is it serving the same model and flags ({client.base_url})?")


def buffers_fit(sender: Any, ranks: Sequence[PreparedRank]) -> bool:
    """The sender's slots already hold the largest parameter group of ``ranks`` (and its spare bytes)."""
    buffers = sender._buffers
    if buffers is None:
        return False
    need = slot_size(sender.settings.buffer_size, largest_group(ranks))
    return buffers.slot_bytes >= need and buffers.spare_bytes >= spare_bytes(need, sender._bases)


def largest_group(ranks: Sequence[PreparedRank]) -> int:
    return max((max((g.nbytes for g in p.replica.groups), default=0) for p in ranks), default=0)


def apply_engine_set(sender: Any, surveys: Sequence[Survey], transport: str, why: str, *,
                     incremental: bool) -> None:
    """Plan ``surveys`` (the whole new set, in order), prepare this sender's engine ranks (replicas
    reused), check every publication it will write, then attach.

    ``incremental``: the targets the sender already has (same engine, rank and process) stay
    attached as they are (their deltas go on) and only the others are fetched and attached; targets
    no longer planned for this sender are detached after the new ones attached. Otherwise (a connect)
    every target is detached first and attached again. A failure before attaching leaves the sender
    as it was; one while attaching detaches what it attached (and, not incremental, leaves the sender
    disconnected). Both re-raise."""
    phases = sender.connect_phases
    mine = plan_of(sender, surveys)
    phases.lap("identity + plan")
    sender._wait_for_warmup([s.layout for s in surveys], mine)
    old_ranks = {(p.layout_key, p.rank): p for p in sender._ranks} if incremental else {}
    kept = {(t.engine.name, t.rank): t for p in sender._ranks for t in p.targets} if incremental else {}
    progress = Progress("connect: engine ranks prepared (replica + loader probe)", len(mine))
    ranks: list[PreparedRank] = []
    for i, entry in enumerate(mine):
        layout = surveys[entry.engines[0]].layout
        prev = old_ranks.get((layout.key, entry.engine_rank))
        ranks.append(PreparedRank(layout.key, entry.engine_rank, prev.replica, prev.stager) if prev is not None
                     else sender._prepare(layout, entry.engine_rank))
        progress.step(i + 1)
    progress.done()
    phases.lap("replicas")
    if incremental and not buffers_fit(sender, ranks):  # larger slots: the writer is made again
        incremental, kept = False, {}
    members = getattr(sender, "_members", {})
    todo: list[tuple[PreparedRank, Survey, EnginePublication, Any]] = []  # (rank, engine, publication, kept target)
    for p, entry in zip(ranks, mine):
        for e in entry.engines:
            s = surveys[e]
            t = kept.get((s.client.name, p.rank))
            if t is not None and (s.instance is None or t.instance == s.instance):
                todo.append((p, s, t.publication, t))
                continue
            ahead = members[s.client.name].publications.pop(p.rank, None) if s.client.name in members else None
            todo.append((p, s, ahead if ahead is not None else fetch_publication(sender, p, s, transport), None))
    check_sessions([session_claim(s.client, pub, s.info) for _, s, pub, _ in todo])
    phases.lap("publication checks")
    keep_ids = {id(t) for *_, t in todo if t is not None}
    dropped = [t for p in sender._ranks for t in p.targets if id(t) not in keep_ids]
    if not incremental:
        sender._disconnect_all(wait=False)
        if transport != sender.transport:  # auto, engines of another transport than the agent's
            sender._drop_transport()
            sender.transport, sender.transport_why = transport, why
    phases.lap("detach")
    attached: list[Any] = []
    info_of = {s.client.name: s.info for s in surveys}

    def recheck(p: PreparedRank, client: SglangEngine, fresh: EnginePublication) -> None:  # a later epoch's
        check_publication(p, client, fresh, transport)
        check_sessions([session_claim(client, fresh, info_of[client.name])])
    try:
        if not incremental:
            sender._ensure_buffers(largest_group(ranks))
        for p, s, pub, t in todo:
            if t is None:
                sender._next_writer_id += 1
                t = attach_target(sender._transport, sender._writer, sender._next_writer_id - 1, p.rank, s.client,
                                  pub, check=functools.partial(recheck, p, s.client))
                t.instance = s.instance
                phases.count("peer connects")
                attached.append(t)
            p.targets.append(t)
        phases.lap("peer connect")
        for transform in sender.transforms:
            transform.connect(ranks)
        phases.lap("transforms")
        if sender._bases is not None:  # the bases' first touch here, not in the first update
            sender._bases.prepare(ranks, sender.settings.buffer_device, phases)
    except BaseException:
        sender._detach(attached)
        raise
    if incremental:
        sender._detach(dropped)
        if sender.recorder is not None:
            sender.recorder.stop(timeout=0)
            sender.recorder = None
    sender._ranks = ranks
    sender._engines = [s.client for s in surveys]
    for s in surveys:
        m = members.get(s.client.name)
        if m is None:
            m = members[s.client.name] = EngineMember(s.client)
        m.client, m.state, m.reason, m.survey = s.client, READY, "", s
        m.instance = s.instance or m.instance
    for name in [n for n in members if n not in info_of and members[n].state != JOINING]:
        del members[name]


def follow_engines(sender: Any, epochs: dict[str, int], instances: dict[str, str]) -> list[str]:
    """Before any slot is posted: the engine ranks whose engine is another process than the one
    attached to (begin answered another ``instance``: restarted at the same address) are re-planned
    -- the engine read again, its layout and build checked, each rank's publication fetched, checked
    and attached under the same writer id; its delta claim was refused by the new process, so it is
    written in full. The ranks whose registration epoch moved on (a takeover revoked the old
    endpoints, transport/revocation.py) are re-attached once their publication holds the same table.
    Answers the engines re-attached."""
    moved: set[str] = set()
    restarted: dict[str, Survey] = {}
    for p in sender._ranks:
        for t in p.targets:
            name = t.engine.name
            instance = instances.get(name)
            if instance and t.instance and instance != t.instance:
                s = restarted.get(name)
                if s is None:
                    s = restarted[name] = _resurvey(sender, t.engine, p.layout_key, instance)
                pub = fetch_publication(sender, p, s, sender.transport)
                check_sessions([session_claim(t.engine, pub, s.info)])
                what = f"restarted (process {t.instance} -> {instance})"
            else:
                if instance and not t.instance:
                    t.instance = instance  # an engine that said none at connect: its first begin says it
                epoch = epochs.get(name)
                if not epoch or not t.publication.epoch or t.publication.epoch == epoch:  # 0: publishes none
                    continue
                pub = _epoch_publication(sender, p, t, epoch)
                what = f"epoch {t.publication.epoch} -> {epoch} (a takeover revoked the old registrations)"
            transports.detach_engine(sender._transport, sender._writer, t.writer_id)
            transports.attach_engine(sender._transport, sender._writer, t.writer_id, t.name, pub)
            logger.warning("engine %s rank %d: %s; re-attached", name, t.rank, what)
            t.publication, t.instance = pub, instance or t.instance
            moved.add(name)
    members = getattr(sender, "_members", {})
    for name, s in restarted.items():
        if name in members:
            m = members[name]
            m.restarts, m.instance, m.survey, m.version = m.restarts + 1, s.instance, s, None
    return sorted(moved)


def _resurvey(sender: Any, client: SglangEngine, layout_key: str, instance: str) -> Survey:
    info = client.server_info()
    layout, identity = layout_and_identity(client, info, sender.config)
    if layout.key != layout_key:
        raise EngineError(f"engine {client.name} restarted (process {instance}) with another shard layout "
                          f"({layout.describe()}); nothing was written", engine=client.name,
                          hint="remove_engines([...]) and add_engines([...]) to plan it again")
    s = Survey(client, info, layout, identity)
    return s if s.instance == instance else Survey(client, {**info, "p2pw_weight_update": {"instance": instance}},
                                                   layout, identity)


def _epoch_publication(sender: Any, p: PreparedRank, t: Any, epoch: int) -> EnginePublication:
    pub = EnginePublication.from_json(t.engine.transfer_engine_info(t.rank))
    if pub.epoch != epoch:
        raise EngineError(f"engine {t.engine.name} rank {t.rank} publishes epoch {pub.epoch}, not the epoch {epoch} "
                          f"its begin_weight_update answered (another takeover?); nothing was written",
                          engine=t.engine.name, rank=t.rank, hint="retry the update")
    check_publication(p, t.engine, pub, sender.transport)
    if pub.params != t.publication.params:
        raise EngineError(f"engine {t.engine.name} rank {t.rank} re-published a different weights table at epoch "
                          f"{epoch}; nothing was written", engine=t.engine.name, rank=t.rank,
                          hint="reconnect the sender (sender.connect) to plan against the engine again")
    return pub
