"""An engine whose writes failed mid-update fails that update alone and the others commit
(docs/sender.md, "The engine set"): under ``on_engine_down="skip"`` any engine whose writes failed
(it died, or its registrations are gone); under the default ``"fail"`` only an engine that is another
process now than the one that answered the update's begin (restarted mid-update: its new process
holds nothing of this update, so nothing is torn by leaving it out). Each sender decides from the
gathered statuses and, for a restart, the engine's own ``/server_info``; sender 0 leaves the engine
out of the session's end (``UpdateSession.drop``: given up there, torn until a complete update) and
the sender forgets its last commit, so that it is written in full when it answers again."""
from __future__ import annotations

from typing import Any


def isolate_failed_engines(update: Any, failures: dict[str, str]) -> dict[str, str]:
    """``failures`` (target -> why, every sender's) with the engines left out removed; unchanged
    unless the update may skip engines and every failure is an engine rank's writes on some but
    not all of the update's engines (a sender's own failure fails everyone, as always)."""
    if not failures:
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
    if getattr(update, "isolate_failed", False):
        reasons = {n: f"its writes failed mid-update ({why})" for n, why in by_engine.items()}
    else:
        reasons = _restarted(update, by_engine)
        if reasons is None:
            return failures
    if update._session is not None:
        update._session.drop(by_engine, "; ".join(by_engine.values()))
    update._engines = [e for e in update._engines if e.name not in by_engine]
    update.__dict__.setdefault("engines_skipped", {}).update(reasons)
    if update._deltas is not None:
        for name in by_engine:
            update._deltas.bases.identities.pop(name, None)
    return {}


def _restarted(update: Any, by_engine: dict[str, str]) -> dict[str, str] | None:
    """Each failed engine restarted since the update's begin (another ``instance`` now), with why;
    None when any of them is not known to have restarted (down, or the same process)."""
    begun = update._session.instances if update._session is not None else getattr(update, "begin_instances", {})
    by_name = {e.name: e for e in update._engines}
    reasons = {}
    for name, why in by_engine.items():
        try:
            state = by_name[name].server_info().get("p2pw_weight_update") or {}
        except Exception:  # noqa: BLE001 - unreachable: down, which the caller's policy decides
            return None
        now, then = state.get("instance"), begun.get(name)
        if not (isinstance(now, str) and then and now != then):
            return None
        reasons[name] = f"restarted mid-update (process {then} -> {now}); its writes failed ({why})"
    return reasons
