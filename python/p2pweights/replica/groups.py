"""Parameter groups: the connected components of HF names and parameters.

A group is the unit the sender loads: once every HF tensor of a group has arrived, the replica's
loaders can produce every byte of its parameters (q/k/v → qkv_proj, gate/up → gate_up_proj,
all local experts of a layer → w13/w2). Each group has a fixed layout inside a transfer slot.
An FP8 weight and its ``weight_scale_inv`` are always in one group: they feed different parameters,
but sglang reads both together (DeepSeek's ``post_load_weights`` dequantizes ``kv_b_proj`` from its
weight and scale), and a sender quantizing on send produces them together.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..models.checkpoint import TensorSpec
from ..models.quant import weight_name

SLOT_ALIGNMENT = 256  # bytes; every parameter starts at a multiple of this inside a slot


@dataclass(frozen=True)
class SlotRegion:
    """Where one parameter's bytes sit in a slot, for the writer."""

    param_name: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ParameterGroup:
    index: int
    params: tuple[str, ...]  # engine parameter names, in the model's order
    hf_names: tuple[str, ...]  # every HF tensor the group's loaders read
    regions: tuple[SlotRegion, ...]  # one per parameter, same order as params

    @property
    def nbytes(self) -> int:
        """Slot bytes the group needs (with alignment padding)."""
        last = self.regions[-1]
        return last.offset + last.nbytes


def _align(n: int, to: int = SLOT_ALIGNMENT) -> int:
    return (n + to - 1) // to * to


def build_groups(sources: Mapping[str, list[str]], param_specs: Mapping[str, TensorSpec]) -> list[ParameterGroup]:
    """Connected components over (parameter — HF name) edges; parameter order is kept."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a: str, b: str) -> None:
        a, b = find(a), find(b)
        if a != b:
            parent[a] = b

    hf_seen: set[str] = set()
    for pname, hf_names in sources.items():
        for hf in hf_names:
            union("p:" + pname, "h:" + hf)
            hf_seen.add(hf)
    for hf in hf_seen:  # a block scale joins its weight's group
        weight = weight_name(hf)
        if weight is not None and weight in hf_seen:
            union("h:" + hf, "h:" + weight)
    members: dict[str, list[str]] = {}
    for pname in sources:  # dict order = model order
        members.setdefault(find("p:" + pname), []).append(pname)
    groups = []
    for index, params in enumerate(members.values()):
        hf: dict[str, None] = {}
        for p in params:
            hf.update(dict.fromkeys(sources[p]))
        regions, offset = [], 0
        for p in params:
            n = param_specs[p].nbytes
            regions.append(SlotRegion(p, offset, n))
            offset = _align(offset + n)
        groups.append(ParameterGroup(index, tuple(params), tuple(hf), tuple(regions)))
    return groups
