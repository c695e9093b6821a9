"""Which sender writes which engine rank: the rollout-engine rank assignment behind `p2pweights plan`.

Senders are the trainer's data replicas: the ranks that hold the same weights once the trainer has
gathered them (the ranks of one pipeline stage, or every rank when the trainer gathers PP too).
Each PP stage's senders write their own stage's parameters to every engine rank, so the rule below
runs once per stage, over the same senders count and the same targets.

The rule lives in :func:`assign_engine_ranks`. Everything else here describes the cluster.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Sequence

from ..models.engine_layout import EngineLayout
from ..models.shapes import ModelShape, PlanError, check_shardable, fuses_shared_experts
from ..models.stages import stage_layers

__all__ = [
    "Engine",
    "Plan",
    "SenderTargets",
    "TrainerLayout",
    "assign_engine_ranks",
    "layout_label",
    "make_plan",
]


@dataclass(frozen=True)
class TrainerLayout:
    """The trainer's parallelism: GPUs in all, TP, PP, EP, FSDP (parameters further sharded over
    that many data-parallel ranks, ZeRO-3 style; only the cost model's gather reads it), whether
    it gathers PP as well (then every rank holds the whole model and there is one stage of senders),
    and how a stage's senders share its writes (``split``; only the cost model reads it)."""

    gpus: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    pp_gathered: bool = False
    fsdp: int = 1
    #: how a stage's senders share its writes (models/stages.py SPLITS): whole engine ranks each, or
    #: the stage's layers split over them, each writing its layers to every engine rank
    split: str = "engine_ranks"

    @property
    def stages(self) -> int:
        """Pipeline stages whose senders write separately."""
        return 1 if self.pp_gathered else self.pp

    @property
    def senders_per_stage(self) -> int:
        return self.gpus // self.stages


@dataclass(frozen=True)
class Engine:
    """One rollout engine: its GPU count (one engine rank per GPU) and its shard layout (an
    :class:`EngineLayout`; the rule below only compares layouts, so any hashable key will do --
    the sender passes ``EngineLayout.key``)."""

    gpus: int
    layout: EngineLayout | Hashable


@dataclass
class SenderTargets:
    """One engine rank a sender prepares (loads into its slots once) and the engines it writes
    those bytes to."""

    sender: int
    engine_rank: int
    layout: EngineLayout | Hashable
    engines: list[int] = field(default_factory=list)


def layout_label(layout: EngineLayout, shape: ModelShape | None = None) -> str:
    """``tp=8,ep=8,dp=8,dp_lm_head=1,fused_shared_experts=1``: a layout in `plan`'s own keys
    (the non-default ones), as its text and JSON print it."""
    parts = [f"tp={layout.tp}"]
    if layout.ep > 1:
        parts.append(f"ep={layout.ep}")
    if layout.attn_dp > 1:
        parts.append(f"dp={layout.attn_dp}")
    if layout.dp_lm_head:
        parts.append("dp_lm_head=1")
    fused = layout.shared_experts_fusion if shape is None else fuses_shared_experts(shape, layout)
    if fused:
        parts.append("fused_shared_experts=1")
    return ",".join(parts)


def assign_engine_ranks(senders: int, engines: Sequence[Engine], *, balanced: bool = False) -> list[SenderTargets]:
    """Give every (engine, engine rank) exactly one of ``senders`` senders.

    1. Every sender first gets one target, in order (engine 0 rank 0, rank 1, ..., engine 1 ...),
       so that all senders write in parallel.
    2. Each remaining target goes to a sender that already prepares that same engine rank of the
       same shard layout -- the one writing to the fewest engines so far (lowest index on a tie) --
       so its bytes are prepared once and written to one more engine.
    3. Else it goes round robin over the senders.

    Engine ranks of different shard layouts hold different bytes, so "the same engine rank" means
    the same rank index *and* layout. Returns one entry per (sender, engine rank, layout), ordered
    by sender, then by when the sender first got that engine rank.

    ``balanced=True`` (opt-in; ``p2pweights plan --balanced``) caps rule 2: a sender is reused only
    while it writes to fewer than ⌈targets / senders⌉ engines, and rule 3 then picks the sender
    writing the fewest (instead of round robin). With mixed shard layouts the plain rule can pile
    hundreds of writes on a few senders; the cap trades that for more engine ranks prepared per sender.
    """
    if senders < 1:
        raise PlanError("--trainer: no senders; gpus must be at least the number of PP stages")
    by_sender: list[list[SenderTargets]] = [[] for _ in range(senders)]
    writes = [0] * senders  # engines each sender writes to, counted per engine rank
    # (layout, engine rank) -> heap of (writes when pushed, sender, its entry); entries go stale
    # when that sender gains writes elsewhere and are refreshed when they surface.
    preparing: dict[tuple[Hashable, int], list[tuple[int, int, SenderTargets]]] = {}
    next_first = 0
    round_robin = 0
    limit = -(-sum(e.gpus for e in engines) // senders)  # ⌈targets / senders⌉
    least: list[tuple[int, int]] = [(0, i) for i in range(senders)]  # (writes when pushed, sender), lazily refreshed

    def give(sender: int, engine: int, rank: int, layout: Hashable) -> None:
        entry = SenderTargets(sender, rank, layout, [engine])
        by_sender[sender].append(entry)
        writes[sender] += 1
        heapq.heappush(preparing.setdefault((layout, rank), []), (writes[sender], sender, entry))

    for engine, (gpus, layout) in enumerate((e.gpus, e.layout) for e in engines):
        for rank in range(gpus):
            if next_first < senders:  # 1. one each, in order
                give(next_first, engine, rank, layout)
                next_first += 1
                continue
            heap = preparing.get((layout, rank))
            if heap:  # 2. a sender already preparing this engine rank, fewest engines first
                while heap[0][0] != writes[heap[0][1]]:
                    _, sender, entry = heapq.heappop(heap)
                    heapq.heappush(heap, (writes[sender], sender, entry))
                if not balanced or heap[0][0] < limit:
                    _, sender, entry = heapq.heappop(heap)
                    entry.engines.append(engine)
                    writes[sender] += 1
                    heapq.heappush(heap, (writes[sender], sender, entry))
                    continue
            if balanced:  # 3'. the sender writing to the fewest engines so far
                while least[0][0] != writes[least[0][1]]:
                    _, sender = heapq.heappop(least)
                    heapq.heappush(least, (writes[sender], sender))
                _, sender = heapq.heappop(least)
                give(sender, engine, rank, layout)
                heapq.heappush(least, (writes[sender], sender))
                continue
            give(round_robin, engine, rank, layout)  # 3. round robin
            round_robin = (round_robin + 1) % senders
    return [entry for entries in by_sender for entry in entries]


@dataclass
class Plan:
    """The assignment for every PP stage. Each stage has the same senders and the same targets, so
    the rule runs once and :meth:`entries` stamps the stage on it."""

    trainer: TrainerLayout
    engines: list[Engine]
    per_stage: list[SenderTargets]
    stage_bounds: list[tuple[int, int]]

    def entries(self) -> Iterator[tuple[int, SenderTargets]]:
        """(pp_stage, entry) for every engine rank a sender of any stage prepares."""
        for stage in range(self.trainer.stages):
            for entry in self.per_stage:
                yield stage, entry

    @property
    def engine_ranks(self) -> int:
        return sum(e.gpus for e in self.engines)

    @property
    def active_senders_per_stage(self) -> int:
        return len({e.sender for e in self.per_stage})

    @property
    def max_engines_per_sender(self) -> int:
        """The most engine-rank writes one sender makes in a stage."""
        counts: dict[int, int] = {}
        for e in self.per_stage:
            counts[e.sender] = counts.get(e.sender, 0) + len(e.engines)
        return max(counts.values())

    @property
    def max_engine_ranks_per_sender(self) -> int:
        """The most engine ranks one sender prepares in a stage."""
        counts: dict[int, int] = {}
        for e in self.per_stage:
            counts[e.sender] = counts.get(e.sender, 0) + 1
        return max(counts.values())

    def senders_json(self) -> list[dict]:
        return [
            {"sender": e.sender, "pp_stage": stage, "engine_rank": e.engine_rank, "engines": list(e.engines)}
            for stage, e in self.entries()
        ]


def make_plan(
    trainer: TrainerLayout,
    engines: Sequence[Engine],
    shape: ModelShape | None = None,
    *,
    balanced: bool = False,
) -> Plan:
    """Check the cluster description and assign engine ranks for every PP stage."""
    _check_trainer(trainer, shape)
    if not engines:
        raise PlanError("--engines: no engines; give at least one, e.g. --engines 2x8")
    for i, engine in enumerate(engines):
        if engine.gpus < 1:
            raise PlanError(f"--engines: engine {i} has {engine.gpus} GPUs; every engine needs at least one")
        if engine.layout.tp != engine.gpus:
            raise PlanError(
                f"--engine: tp={engine.layout.tp} but engine {i} has {engine.gpus} GPUs; "
                "leave tp out (it defaults to each engine's GPU count) or make them equal"
            )
        if shape is not None:
            check_shardable(shape, engine.layout)
    layers = shape.layers if shape is not None else max(trainer.pp, 1)
    bounds = stage_layers(layers, trainer.stages)
    per_stage = assign_engine_ranks(trainer.senders_per_stage, engines, balanced=balanced)
    return Plan(trainer=trainer, engines=list(engines), per_stage=per_stage, stage_bounds=bounds)


def _check_trainer(trainer: TrainerLayout, shape: ModelShape | None) -> None:
    t = trainer
    if t.gpus < 1:
        raise PlanError(f"--trainer: gpus={t.gpus}; the trainer needs at least one GPU")
    for name, value in (("tp", t.tp), ("pp", t.pp), ("ep", t.ep), ("fsdp", t.fsdp)):
        if value < 1:
            raise PlanError(f"--trainer: {name}={value} must be at least 1")
    if t.gpus % (t.tp * t.pp):
        raise PlanError(
            f"--trainer: gpus={t.gpus} is not a multiple of tp*pp={t.tp * t.pp}; make gpus = tp*pp*dp"
        )
    if (t.gpus // (t.tp * t.pp)) % t.fsdp:
        raise PlanError(
            f"--trainer: fsdp={t.fsdp} does not divide the {t.gpus // (t.tp * t.pp)} data-parallel ranks "
            "(gpus / (tp*pp)); pick a divisor"
        )
    if (t.gpus // t.pp) % t.ep:
        raise PlanError(
            f"--trainer: ep={t.ep} does not divide the {t.gpus // t.pp} ranks of a PP stage; pick a divisor"
        )
    if shape is None:
        return
    if shape.heads % t.tp:
        raise PlanError(
            f"--trainer: tp={t.tp} does not divide the {shape.heads} attention heads of "
            f"{shape.architecture}; use a tp that divides {shape.heads}"
        )
    if t.pp > shape.layers:
        raise PlanError(
            f"--trainer: pp={t.pp} is more PP stages than the model's {shape.layers} layers; "
            f"use pp <= {shape.layers}"
        )
    if shape.experts and shape.experts % t.ep:
        raise PlanError(f"--trainer: ep={t.ep} does not divide the {shape.experts} experts; pick a divisor")
