"""The sender's host path per tensor: what the trainer's pushes cost a sender's CPU, counted per HF tensor.

A trainer hands each of its senders its PP stage's full HF checkpoint, one tensor at a time (every
sender of a stage is a data replica: it is pushed every tensor of the stage, and skips the ones its
engine ranks load nothing from after the same checks). Each push costs the sender's host a fixed
time however large the tensor: the name's table look-up, the shape and dtype checks, the staging
bookkeeping and the copy plan's per-input work (docs/sender.md, sender/bulk_push.py). An HF-layout
MoE checkpoint holds every expert as its own tensors, so a stage of Qwen3-235B-A22B is ~18,500
tensors and the per-tensor cost, not the bytes, sets this stage's time.

The cost model (cost.py) prices it as one more stage of the sender's pipeline: the host path runs
while earlier slots are on the wire, so it overlaps with the writes and ``p2p_seconds`` is the
largest stage, the host path included. Its serial start (the tensors of the first slot, before the
first write can leave) is a fixed cost, left out with the others (control plane, first slot's
latency).

The count comes from the model registry's checkpoint schema (``trainer_tensors``: the tensors a
trainer holds, no FP8 scales) split over the PP stages by the sender's own rule (``models/stages.py``).
"""
from __future__ import annotations

from typing import Any, Sequence

from ..errors import P2PWeightsError
from ..models.checkpoint import trainer_tensors
from ..models.stages import writers_of

# us of sender host time per pushed HF tensor: the bulk push (Update.push_many), measured by
# benchmarks/bench_push.py (staging + loading per tensor; its target, <= 5 us)
HOST_US_PER_TENSOR = 5.0
SENDER_HOST_PATH = "sender per-tensor host path"


def stage_tensor_counts(config: Any, num_layers: int, stages: int, writers: int = 1) -> tuple[int, ...] | None:
    """HF tensors a trainer pushes to each sender of each of ``stages`` PP stages (the whole
    checkpoint when ``stages`` is 1, as with ``--pp-gathered``), or None for an architecture whose
    checkpoint schema the registry lacks (then the host path is not priced). ``writers`` > 1: each
    stage's layers split over that many senders (split="layers"): one count per (stage, writer)."""
    try:
        names = trainer_tensors(config)
    except P2PWeightsError:
        return None
    counts = [0] * (stages * writers)
    for _, (stage, writer) in writers_of(names, num_layers, stages, writers):  # the sender's own rule
        counts[stage * writers + writer] += 1
    return tuple(counts)


def host_path_seconds(tensors: Sequence[int] | None, us_per_tensor: float) -> tuple[int, float]:
    """(most tensors one sender is pushed, its host path in seconds); (0, 0.0) when not counted."""
    if not tensors:
        return 0, 0.0
    most = max(tensors)
    return most, most * us_per_tensor * 1e-6
