"""Predicted seconds of one weight update: P2P writes versus the NCCL broadcast baseline.

The model is deliberately first-order: every link and every sender stage runs at its rate, fixed
costs (HTTP control plane, engine post-processing, the first slot's latency) are left out. Its job
is to name what limits an update and how far it is from the wire floor.

P2P: all PP stages write at once. Each sender runs a pipeline of stages over the same bytes:

- *trainer gather*: before a sender can push its stage's full HF tensors it gathers them from the
  trainer's TP/EP/FSDP shards: every byte of the stage it does not hold itself, at the gather
  bandwidth (every sender of a stage gathers the whole stage: they are data replicas; with
  ``split="layers"`` each gathers, prepares and is pushed only its layers, written to every engine rank);
- *sender production*: the replica's sglang loaders (or, from the second update on, the replayed
  copy plans) fill slots from those tensors: each byte of every engine rank it prepares, once, at
  the production rate -- into the slot itself (GPU slots) or into the GPU staging buffer that
  feeds host slots;
- *sender host<->device copy* (host slots only): the staging buffer's device-to-host copy into the
  pinned slot, each prepared byte once (the NIC then reads host memory);
- *sender NIC*: every byte it writes (each engine rank it prepares, times the engines it writes to).

- *sender per-tensor host path*: the trainer pushes each sender its stage's HF tensors one at a
  time, and each costs the sender's host a fixed time (``host_us_per_tensor``, host_path.py);
  every tensor of the stage, the most any sender is pushed.

An engine GPU's NIC receives exactly the bytes its rank holds, from one sender per stage. NICs: a
node's ``nics_per_node`` NICs of ``nic_gbps`` each are shared evenly by its ``gpus_per_node`` GPUs
(trainer and engine nodes alike); by default one NIC per GPU.

Overlap: the sender's double-buffered pipeline overlaps every stage with the others -- the trainer
pushes tensors as it gathers them, one slot fills (staging copies out on a side stream) while the
other is written -- so an update takes as long as its slowest stage, not their sum:
``p2p_seconds = max(stage seconds)``. A trainer that gathers everything before its first push pays
the gather in series instead (add ``gather_seconds``). The staged host-slot path measured on the
H200 (0.986 x pinned D2H with loaders at several hundred GB/s) is this max.

Broadcast baseline: one sender per PP stage broadcasts the stage's full (unsharded HF) tensors to
every engine GPU, stages one after the other; a pipelined broadcast runs at the NIC bandwidth
whatever the number of receivers, so it takes full model bytes / NIC bandwidth.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Hashable, Sequence

from ..models.shapes import ModelShape, PlanError, RankBytes, engine_rank_bytes, full_model_bytes
from ..models.stages import layer_writers, writer_layers
from .assign import Plan, TrainerLayout, assign_engine_ranks
from .host_path import HOST_US_PER_TENSOR, SENDER_HOST_PATH, host_path_seconds

NIC_GBPS = 50.0  # GB/s per NIC: a 400 Gb/s NIC, one per GPU unless nics_per_node says otherwise
GPUS_PER_NODE = 8
HOST_DEVICE_GBPS = 55.0  # GB/s: pinned host<->device copies measured on an H200 host
# GB/s one sender's slot production reaches from GPU tensors, per way of filling slots. loader:
# sglang's loaders called from Python, measured on the H200 for a Qwen3-4B TP2 rank into GPU slots
# (366 GB/s; 215-459 between calls: Python-bound). replay: recorded copy plans replayed as batched
# copies -- issue 17's target, NOT measured yet.
PRODUCTION_GBPS = {"loader": 366.0, "replay": 1000.0}
PRODUCTION_MEASURED = {"loader": True, "replay": False}
# GB/s of the trainer's gather (all-gather bus bandwidth over NVLink inside one 8-GPU node): an
# assumption, not measured here (one GPU); set --gather-gbps to the NIC's when the gather crosses nodes.
GATHER_GBPS = 360.0
GB = 1e9

ENGINE_NIC = "engine NIC"
SENDER_NIC = "sender NIC"
SENDER_HOST_COPY = "sender host<->device copy"
SENDER_PRODUCTION = "sender production"
TRAINER_GATHER = "trainer gather"


@dataclass(frozen=True)
class Links:
    """Link bandwidths and sender rates in GB/s (1e9 bytes per second), and where the
    transfer-buffer slots live."""

    nic_gbps: float = NIC_GBPS  # each NIC's bandwidth
    host_device_gbps: float = HOST_DEVICE_GBPS
    host_slots: bool = True  # slots in pinned host memory: each prepared byte crosses device->host once
    production: str = "loader"  # how slots are filled: "loader" (sglang's loaders) or "replay" (copy plans)
    production_gbps: float | None = None  # None: PRODUCTION_GBPS[production]
    gather_gbps: float = GATHER_GBPS
    host_us_per_tensor: float = HOST_US_PER_TENSOR  # sender host time per pushed HF tensor, us
    nics_per_node: int | None = None  # None: one NIC per GPU
    gpus_per_node: int = GPUS_PER_NODE

    def __post_init__(self) -> None:
        if not self.host_us_per_tensor >= 0:
            raise PlanError(f"--host-us-per-tensor: {self.host_us_per_tensor:g}; must be 0 or more")
        for flag, n in (("--nics-per-node", self.nics_per_node), ("--gpus-per-node", self.gpus_per_node)):
            if n is not None and n < 1:
                raise PlanError(f"{flag}: {n}; a node has at least one")
        if self.production not in PRODUCTION_GBPS:
            raise PlanError(f"--production: {self.production!r} is not one of {', '.join(PRODUCTION_GBPS)}")
        for flag, v in (("--nic-gbps", self.nic_gbps), ("--host-device-gbps", self.host_device_gbps),
                        ("--production-gbps", self.production_rate), ("--gather-gbps", self.gather_gbps)):
            if not v > 0:
                raise PlanError(f"{flag}: {v:g} GB/s; bandwidths and rates must be positive")

    @property
    def nic_per_gpu(self) -> float:
        """GB/s one GPU's writes (or reads) get: its node's NICs shared evenly by its GPUs."""
        if self.nics_per_node is None:
            return self.nic_gbps
        return self.nic_gbps * self.nics_per_node / self.gpus_per_node

    @property
    def production_rate(self) -> float:
        """GB/s of slot production: the given rate, else the default of the production mode."""
        return PRODUCTION_GBPS[self.production] if self.production_gbps is None else self.production_gbps

    @property
    def production_measured(self) -> bool:
        """False while the rate is a default that was never measured (replay's target)."""
        return self.production_gbps is not None or PRODUCTION_MEASURED[self.production]

    def as_json(self) -> dict:
        return {"nic_gbps": self.nic_gbps, "host_device_gbps": self.host_device_gbps,
                "slots": "host" if self.host_slots else "gpu", "production": self.production,
                "production_gbps": self.production_rate, "production_measured": self.production_measured,
                "gather_gbps": self.gather_gbps, "host_us_per_tensor": self.host_us_per_tensor,
                "nics_per_node": self.nics_per_node or self.gpus_per_node, "gpus_per_node": self.gpus_per_node,
                "nic_gbps_per_gpu": self.nic_per_gpu}


@dataclass(frozen=True)
class Cost:
    """What `plan` reports. Bytes are per PP stage for senders and whole for engine ranks."""

    bytes_per_engine_rank_max: int
    bytes_per_sender_max: int  # bytes one sender writes onto the wire (prepared bytes x engines)
    p2p_seconds: float
    broadcast_seconds: float
    floor_seconds: float  # largest bytes per engine GPU / NIC bandwidth: no plan beats it
    bottleneck: str
    bytes_prepared_per_sender_max: int = 0  # bytes one sender's loaders (or replay) fill, once each
    bytes_gathered_per_sender_max: int = 0  # bytes one sender gathers from the trainer's other shards
    production_seconds: float = 0.0
    gather_seconds: float = 0.0
    tensors_per_sender_max: int = 0  # HF tensors one sender is pushed (0: not counted)
    host_path_seconds: float = 0.0
    # not part of the JSON `cost` object, shown in the table
    full_model_bytes: int = 0
    seconds_by_link: tuple[tuple[str, float], ...] = ()

    def as_json(self) -> dict:
        keys = (
            "bytes_per_engine_rank_max",
            "bytes_per_sender_max",
            "bytes_prepared_per_sender_max",
            "bytes_gathered_per_sender_max",
            "p2p_seconds",
            "production_seconds",
            "gather_seconds",
            "tensors_per_sender_max",
            "host_path_seconds",
            "broadcast_seconds",
            "floor_seconds",
            "bottleneck",
        )
        d = asdict(self)
        return {**{k: d[k] for k in keys}, "seconds_by_stage": dict(self.seconds_by_link)}


def predict(plan: Plan, shape: ModelShape, links: Links = Links(), dtype: str = "bf16",
            tensors: Sequence[int] | None = None) -> Cost:
    """Cost of one update under ``plan`` for a model of ``shape`` sent in ``dtype``; ``tensors``:
    the HF tensors each PP stage's senders are pushed (host_path.stage_tensor_counts), None to
    leave the per-tensor host path out."""
    rank_bytes: dict[Hashable, RankBytes] = {}
    for engine in plan.engines:
        if engine.layout not in rank_bytes:
            rank_bytes[engine.layout] = engine_rank_bytes(shape, engine.layout, dtype)

    stages = plan.trainer.stages
    gather = TrainerShards(shape, plan.trainer, dtype)
    wire_max = prepared_max = gathered_max = 0
    if plan.trainer.split == "layers":
        wire_max, prepared_max, gathered_max = _split_layers(plan, shape, rank_bytes, gather)
    for stage, (start, end) in enumerate(plan.stage_bounds if plan.trainer.split == "engine_ranks" else ()):
        first, last = stage == 0, stage == stages - 1
        stage_bytes = {
            layout: rb.of_layers(start, end, first=first, last=last) for layout, rb in rank_bytes.items()
        }
        wire: dict[int, int] = {}
        prepared: dict[int, int] = {}
        for entry in plan.per_stage:
            n = stage_bytes[entry.layout]
            prepared[entry.sender] = prepared.get(entry.sender, 0) + n
            wire[entry.sender] = wire.get(entry.sender, 0) + n * len(entry.engines)
        wire_max = max(wire_max, max(wire.values()))
        prepared_max = max(prepared_max, max(prepared.values()))
        gathered_max = max(gathered_max, gather.gathered(start, end, first=first, last=last))

    engine_rank_max = max(rb.total for rb in rank_bytes.values())
    nic = links.nic_per_gpu * GB
    production_s = prepared_max / (links.production_rate * GB)
    gather_s = gathered_max / (links.gather_gbps * GB)
    by_link = [(ENGINE_NIC, engine_rank_max / nic), (SENDER_NIC, wire_max / nic)]
    if links.host_slots:
        by_link.append((SENDER_HOST_COPY, prepared_max / (links.host_device_gbps * GB)))
    by_link += [(SENDER_PRODUCTION, production_s), (TRAINER_GATHER, gather_s)]
    tensors_max, host_s = host_path_seconds(tensors, links.host_us_per_tensor)
    if tensors_max:
        by_link.append((SENDER_HOST_PATH, host_s))
    bottleneck, p2p = max(by_link, key=lambda kv: kv[1])  # first listed wins a tie
    full = full_model_bytes(shape, dtype).total
    return Cost(
        bytes_per_engine_rank_max=engine_rank_max,
        bytes_per_sender_max=wire_max,
        p2p_seconds=p2p,
        broadcast_seconds=full / nic,
        floor_seconds=engine_rank_max / nic,
        bottleneck=bottleneck,
        bytes_prepared_per_sender_max=prepared_max,
        bytes_gathered_per_sender_max=gathered_max,
        production_seconds=production_s,
        gather_seconds=gather_s,
        tensors_per_sender_max=tensors_max,
        host_path_seconds=host_s,
        full_model_bytes=full,
        seconds_by_link=tuple(by_link),
    )


def _split_layers(plan: Plan, shape: ModelShape, rank_bytes: dict[Hashable, RankBytes],
                  gather: "TrainerShards") -> tuple[int, int, int]:
    """(wire, prepared, gathered) bytes of the busiest sender when each stage's layers are split
    over its senders (split="layers", models/stages.py ``layer_writers``): the senders form groups
    of writers, each group given engine ranks as ``assign_engine_ranks`` gives a sender; each
    sender prepares its layers of its group's engine ranks, writes them to every engine holding
    such a rank, and gathers only its layers from the trainer's shards."""
    stages, senders = plan.trainer.stages, plan.trainer.senders_per_stage
    wire_max = prepared_max = gathered_max = 0
    for stage in range(stages):
        writers, groups = layer_writers(shape.layers, stages, stage, senders)
        by_group: list[list] = [[] for _ in range(groups)]
        for e in assign_engine_ranks(groups, plan.engines):
            by_group[e.sender].append(e)
        for w, (a, b) in enumerate(writer_layers(shape.layers, stages, stage, writers)):
            first, last = stage == 0 and w == 0, stage == stages - 1 and w == writers - 1
            per_rank = {layout: rb.of_layers(a, b, first=first, last=last) for layout, rb in rank_bytes.items()}
            for mine in by_group:
                prepared_max = max(prepared_max, sum(per_rank[e.layout] for e in mine))
                wire_max = max(wire_max, sum(per_rank[e.layout] * len(e.engines) for e in mine))
            gathered_max = max(gathered_max, gather.gathered(a, b, first=first, last=last))
    return wire_max, prepared_max, gathered_max


class TrainerShards:
    """How many bytes of a PP stage's full HF tensors one trainer rank lacks and must gather.

    A rank holds 1/(tp x fsdp) of every dense tensor (attention, dense MLPs, shared experts,
    embedding, LM head, norms: first order, replicated norms counted as sharded) and
    1/min(ep x fsdp, ranks per stage) of the routed experts (EP splits the experts, FSDP the rest of
    the data-parallel ranks); with ``pp_gathered`` the whole model is gathered, so also 1/pp."""

    def __init__(self, shape: ModelShape, trainer: TrainerLayout, dtype: str):
        full = full_model_bytes(shape, dtype)
        self.full = full
        if shape.experts and shape.moe_intermediate:
            no_shared = full_model_bytes(dataclasses.replace(shape, shared_experts=0), dtype)
            no_experts = full_model_bytes(dataclasses.replace(shape, shared_experts=0, moe_intermediate=0), dtype)
            self.routed = tuple(a - b for a, b in zip(no_shared.layers, no_experts.layers))
        else:
            self.routed = (0,) * len(full.layers)
        t = trainer
        pp = t.pp if t.pp_gathered else 1
        self.dense_shards = t.tp * t.fsdp * pp
        self.expert_shards = min(t.ep * t.fsdp, t.gpus // t.pp) * pp

    def gathered(self, start: int, end: int, *, first: bool, last: bool) -> int:
        """Bytes of the stage holding layers [start, end) that one of its ranks gathers."""
        routed = sum(self.routed[start:end])
        dense = self.full.of_layers(start, end, first=first, last=last) - routed
        return dense - dense // self.dense_shards + routed - routed // self.expert_shards
