"""Whether an update of a sender writes deltas, and as which writer of its engine ranks' areas."""
from __future__ import annotations

from typing import Any, Sequence

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
    writer, writers = sender.writer_in_stage()
    return UpdateDeltas(sender._bases, list(ranks), sender._buffers, wanted=not why, off_reason=why, keep=keep,
                        writer=sender.pp_stage * writers + writer, writers=sender.pp_size * writers)
