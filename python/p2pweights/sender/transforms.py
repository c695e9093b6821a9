"""Group transforms: the step between a staged parameter group and the replica's loaders.

The stager releases a group when every HF tensor it needs arrived, as a :class:`GroupLoad` (the
prepared engine rank, the parameter group, its HF tensors). Each transform maps one load to the
loads it becomes, so a transform may

- rewrite the tensors: other values, names or dtypes (FP8 block quantization turns a BF16
  ``weight`` into ``weight`` + ``weight_scale_inv`` of an FP8 replica's group);
- fan one staged group out to several (replica, targets) work items (draft roles need none: the
  prepared rank's replica joins the target's and the draft's parameters, replica/roles.py);
- drop a load (return nothing).

Whatever comes out is loaded as is: the replica checks that the tensors are exactly its group's
HF inputs, and every write is checked against what the engine published (byte counts).
The sender's default is no transform (identity); for an FP8 block-quantized config the
WeightSender adds :class:`~p2pweights.sender.quantize.QuantizeOnSend` after the given ones, so
those see the trainer's tensors (a quantized weight in BF16 without its ``weight_scale_inv``, or
the pre-quantized pair) and the loaders get the engine checkpoint's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from .prepared import PreparedRank


@dataclass
class GroupLoad:
    """One parameter group of one prepared engine rank and the tensors its loaders get."""

    rank: PreparedRank
    group: Any  # p2pweights.replica.ParameterGroup of rank.replica
    tensors: dict[str, Any]  # HF name -> tensor: the group's hf_names (FP8, before quantizing: no scales)


class GroupTransform:
    """The transform interface, and the identity transform.

    ``connect(ranks)`` runs at the end of every ``WeightSender.connect`` with the engine ranks
    the sender prepares (a fan-out transform finds its other replicas there); ``__call__`` maps
    one staged group to the loads it becomes.
    """

    def connect(self, ranks: Sequence[PreparedRank]) -> None:
        pass

    def __call__(self, load: GroupLoad) -> Iterable[GroupLoad]:
        return (load,)


def apply_transforms(transforms: Sequence[GroupTransform], load: GroupLoad) -> list[GroupLoad]:
    """The loads one staged group becomes after every transform, in order."""
    loads = [load]
    for transform in transforms:
        loads = [out for each in loads for out in transform(each)]
    return loads
