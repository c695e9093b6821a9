"""The data plane obeys the session (docs/security.md, "Fencing" and "Epochs"): each engine's
lease deadline reaches its ranks' write threads, and after a takeover moved an engine to a new
epoch its ranks are re-attached (and fenced again) before any slot is posted."""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence


def fence_engine(writer: Any, ranks: Sequence[Any], engine: str, deadline: float) -> None:
    """The lease of ``engine`` now runs to ``deadline`` (``time.monotonic()``; -inf: lost, inf: an
    engine without a lease): its ranks' write threads post nothing after it."""
    left = deadline - time.monotonic()
    for p in ranks:
        for t in p.targets:
            if t.engine.name == engine:
                writer.fence(t.writer_id, left if left == left else -1.0)


def follow_epochs(epochs: dict[str, int], reattach: Callable[[dict[str, int], dict[str, str]], list[str]] | None,
                  writer: Any, ranks: Sequence[Any], session: Any, instances: dict[str, str] | None = None) -> None:
    """Re-attach the engine ranks whose epoch (begin's answer) moved on, or whose engine is another
    process than the one connected to (``instances``: a restart at the same address; ``reattach``:
    the sender's, answering the engines it re-attached), then fence them again: a new connection has
    no deadline."""
    if reattach is None or not (epochs or instances):
        return
    for engine in reattach(epochs, instances or {}):
        if session is not None:
            fence_engine(writer, ranks, engine, session.lease_deadline(engine))
