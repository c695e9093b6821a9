"""Whether an update of a sender writes deltas, and as which writer of its engine ranks' areas."""
from __future__ import annotations

from typing import Any, Sequence

from ..models.stages import area_writer
from .delta_writes import UpdateDeltas


def update_deltas(sender: Any, delta: bool | str, control: bool, ranks: Sequence[Any]) -> UpdateDeltas | None:
    """The update's delta state (delta_writes.py), or None when ``sender`` keeps no bases."""
    if sender._bases is None:
        return None
    if delta not in ("auto", True, False):
        raise ValueError(f'delta must be "auto", True or False, got {delta!r}')
    why, keep = ("" if delta in ("auto", True) else "delta=False for this update"), True
    if not control:  # a coordinator's session: it would have to claim and end for the senders' deltas
        why, keep = "control=False: deltas need the session's owner to be one of the senders", False
    elif sender.settings.open_beside_slots:
        why, keep = "P2PW_OPEN_BESIDE_SLOTS: slots are filled before the engines answer the claim", False
    # PP stages (and split="layers" senders) write the same engine ranks: each its own part of every area
    writer, writers = area_writers(sender)
    return UpdateDeltas(sender._bases, list(ranks), sender._buffers, wanted=not why, off_reason=why, keep=keep,
                        writer=writer, writers=writers)


def area_writers(sender: Any) -> tuple[int, int]:
    """(index, count) of ``sender`` among the writers of each engine rank's area it writes: one per PP
    stage, or with split="layers" every stage's layer writers (models/stages.py ``area_writer``)."""
    if sender.split != "layers":
        return sender.pp_stage, sender.pp_size
    return area_writer(int(sender.config["num_hidden_layers"]), sender.pp_size, sender.pp_stage,
                       sender.writer_in_stage()[0], sender.num_senders)
