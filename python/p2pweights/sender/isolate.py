"""An engine whose writes failed mid-update (it died, or restarted and its old registrations are
gone), under ``on_engine_down="skip"``: that engine alone fails the update and the others commit
(docs/sender.md, "The engine set"). Decided from the gathered statuses, so every sender of a group
decides the same; sender 0 leaves the engine out of the session's end (``UpdateSession.drop``: given
up there, torn until a complete update) and the sender forgets its last commit, so that it is
written in full when it answers again."""
from __future__ import annotations

from typing import Any


def isolate_failed_engines(update: Any, failures: dict[str, str]) -> dict[str, str]:
    """``failures`` (target -> why, every sender's) with the engines left out removed; unchanged
    unless the update may skip engines and every failure is an engine rank's writes on some but
    not all of the update's engines (a sender's own failure fails everyone, as always)."""
    if not failures or not getattr(update, "isolate_failed", False):
        return failures
    names = {e.name for e in update._engines}
    by_engine: dict[str, str] = {}
    for target, why in failures.items():
        engine, _, rank = target.rpartition("/rank")
        if engine not in names or not rank.isdigit():
            return failures
        by_engine.setdefault(engine, f"{target}: {why}")
    if set(by_engine) >= names:
        return failures
    reasons = {n: f"its writes failed mid-update ({why})" for n, why in by_engine.items()}
    if update._session is not None:
        update._session.drop(by_engine, "; ".join(by_engine.values()))
    update._engines = [e for e in update._engines if e.name not in by_engine]
    update.__dict__.setdefault("engines_skipped", {}).update(reasons)
    if update._deltas is not None:
        for name in by_engine:
            update._deltas.bases.identities.pop(name, None)
    return {}
