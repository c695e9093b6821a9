"""Predicted seconds of one weight update: P2P writes versus the NCCL broadcast baseline.

The model is deliberately first-order: every link runs at its bandwidth, the double-buffered
sender overlaps filling a slot with writing the other one (so its time is the slower of the two,
not their sum), and fixed costs (HTTP control plane, engine post-processing, loader compute) are
left out. Its job is to name the link that limits an update and how far it is from the wire floor.

P2P: all PP stages write at once. A sender's NIC carries every byte it writes (each engine rank it
prepares, times the engines it writes it to); with host slots its host<->device link also carries
each prepared byte once (device-to-host into the slot; the NIC then reads host memory). An engine
GPU's NIC receives exactly the bytes that rank holds, from one sender per stage.

Broadcast baseline: one sender per PP stage broadcasts the stage's full (unsharded HF) tensors to
every engine GPU, stages one after the other; a pipelined broadcast runs at the NIC bandwidth
whatever the number of receivers, so it takes full model bytes / NIC bandwidth.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Hashable

from ..models.shapes import ModelShape, RankBytes, engine_rank_bytes, full_model_bytes
from .assign import Plan

NIC_GBPS = 50.0  # GB/s per GPU: a 400 Gb/s NIC
HOST_DEVICE_GBPS = 55.0  # GB/s: pinned host<->device copies measured on an H200 host
GB = 1e9

ENGINE_NIC = "engine NIC"
SENDER_NIC = "sender NIC"
SENDER_HOST_COPY = "sender host<->device copy"


@dataclass(frozen=True)
class Links:
    """Link bandwidths in GB/s (1e9 bytes per second) and where the transfer-buffer slots live."""

    nic_gbps: float = NIC_GBPS
    host_device_gbps: float = HOST_DEVICE_GBPS
    host_slots: bool = True  # slots in pinned host memory: each prepared byte crosses device->host once


@dataclass(frozen=True)
class Cost:
    """What `plan` reports. Bytes are per PP stage for senders and whole for engine ranks."""

    bytes_per_engine_rank_max: int
    bytes_per_sender_max: int  # bytes one sender writes onto the wire (prepared bytes x engines)
    p2p_seconds: float
    broadcast_seconds: float
    floor_seconds: float  # largest bytes per engine GPU / NIC bandwidth: no plan beats it
    bottleneck: str
    # not part of the JSON `cost` object, shown in the table
    bytes_prepared_per_sender_max: int = 0
    full_model_bytes: int = 0
    seconds_by_link: tuple[tuple[str, float], ...] = ()

    def as_json(self) -> dict:
        keys = (
            "bytes_per_engine_rank_max",
            "bytes_per_sender_max",
            "p2p_seconds",
            "broadcast_seconds",
            "floor_seconds",
            "bottleneck",
        )
        d = asdict(self)
        return {k: d[k] for k in keys}


def predict(plan: Plan, shape: ModelShape, links: Links = Links(), dtype: str = "bf16") -> Cost:
    """Cost of one update under ``plan`` for a model of ``shape`` sent in ``dtype``."""
    rank_bytes: dict[Hashable, RankBytes] = {}
    for engine in plan.engines:
        if engine.layout not in rank_bytes:
            rank_bytes[engine.layout] = engine_rank_bytes(shape, engine.layout, dtype)

    stages = plan.trainer.stages
    wire_max = prepared_max = 0
    for stage, (start, end) in enumerate(plan.stage_bounds):
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

    engine_rank_max = max(rb.total for rb in rank_bytes.values())
    nic = links.nic_gbps * GB
    by_link = [(ENGINE_NIC, engine_rank_max / nic), (SENDER_NIC, wire_max / nic)]
    if links.host_slots:
        by_link.append((SENDER_HOST_COPY, prepared_max / (links.host_device_gbps * GB)))
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
        full_model_bytes=full,
        seconds_by_link=tuple(by_link),
    )
