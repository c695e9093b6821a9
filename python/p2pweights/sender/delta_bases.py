"""The sender's delta bases (docs/deltas.md): per prepared engine rank, the engine-format bytes it
last wrote, and per engine the identity its last commit answered; and the spare bytes a slot keeps
for encoded records. One :class:`DeltaBases` per sender, across updates (sender/delta_writes.py
uses it one update at a time)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def spare_bytes(slot_bytes: int, bases: Any = True) -> int:
    """Spare bytes per slot for its encoded records (a quarter of the slot, at least 1 MiB); none
    for a sender that keeps no bases (``bases`` None: delta="off")."""
    return max(1 << 20, int(slot_bytes) // 4) if bases is not None else 0


class DeltaBases:
    """The sender's bases (host copies of what it wrote) and the identities its engines committed."""

    def __init__(self) -> None:
        # (layout, rank, parameter) -> its base: a host array, or a view of the rank's GPU base
        self.arrays: dict[tuple[str, int, str], Any] = {}
        # GPU slots: (layout, rank) -> (one device tensor for the rank's parameters, parameter -> offset)
        self.ranks: dict[tuple[str, int], tuple[Any, dict[str, int]]] = {}
        self.identities: dict[str, dict] = {}  # engine name -> {"epoch", "token"} of its last commit by us
        # (layout, rank) whose bases a delta=False update dropped (staged slots): why the next is full
        self.unkept: set[tuple[str, int]] = set()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t, _ in self.ranks.values())

    def prepare(self, ranks: Sequence[Any], device: str, phases: Any) -> None:
        """At connect: the bases of every rank whose targets publish a delta area, made and touched
        now, so that the first update does not pay the first touch of fresh memory."""
        for p in ranks:
            if any(t.publication.delta_area for t in p.targets):
                self.rank_base(p, device)
        phases.lap("delta bases")

    def rank_base(self, p: Any, device: Any) -> tuple[Any, dict[str, int]]:
        """Rank ``p``'s base, one buffer for its parameters (each on a 256-byte boundary): a numpy
        array for host slots (``device`` "cpu"), else a tensor on that torch device. Made on first
        use; no parameter has a base until it is written once."""
        host = isinstance(device, str) and device == "cpu"
        got = self.ranks.get((p.layout_key, p.rank))
        if got is None or isinstance(got[0], np.ndarray) != host or (not host and got[0].device != device):
            offsets, total = {}, 0
            for name, t in sorted(p.targets[0].publication.params.items()):
                offsets[name] = total
                total += -(-t.nbytes // 256) * 256
            if host:
                buffer = np.zeros(max(total, 1), dtype=np.uint8)
                buffer[::4096] = 1  # every page touched now
            else:
                import torch

                buffer = torch.zeros(max(total, 1), dtype=torch.uint8, device=device)
            got = (buffer, offsets)
            self.ranks[(p.layout_key, p.rank)] = got
            for key in [k for k in self.arrays if k[:2] == (p.layout_key, p.rank)]:
                del self.arrays[key]  # views of a base that is gone
        return got

    def clear(self) -> None:
        self.arrays.clear()
        self.ranks.clear()
        self.identities.clear()
        self.unkept.clear()
