"""``update(verify=True)`` with deltas: every delta engine applies what every sender wrote before any
digest is taken (sender/verify.py asks for the digests; sender/delta_writes.py wrote the deltas)."""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

from ..errors import P2PWeightsError
from .group import SenderStatus, all_failures


def apply_for_verify(deltas: Any, engines: Sequence[Any], ranks: Sequence[Any], *, owner: bool, me: int, size: int,
                     failures: Mapping[str, str], gather: Callable[[SenderStatus], list],
                     control: Callable[[Callable[[], Any]], Any]) -> dict[str, BaseException]:
    """Apply ``deltas`` (an update's delta_writes.UpdateDeltas) now. A sender alone applies its own
    (when it owns the session and its writes returned). In a group every sender takes part, its
    writes failed or not (two gathers each): the manifests meet, the owner (sender 0) applies them
    all unless a sender failed, and every sender learns the outcome. Returns target name -> error for
    the engines whose apply was refused ({}: applied, or nothing to apply)."""
    every: list = []
    failed = dict(failures)
    if size > 1:
        statuses = gather(SenderStatus(me, dict(failures), deltas=deltas.written()))
        every = [st.deltas for st in statuses if st.sender != me]
        failed = all_failures(statuses)
    errors: dict[str, BaseException] = {}
    if owner and not failed:
        try:
            control(lambda: deltas.apply_now(engines, every))
        except P2PWeightsError as e:  # an apply refused (deltas/area.py): its engine's ranks do not verify
            errors = {t.name: e for p in ranks for t in p.targets
                      if t.engine.name == getattr(e, "engine", "")} or {"engines": e}
    if size > 1:
        statuses = gather(SenderStatus(me, {n: str(e) for n, e in errors.items()}))
        for n, why in all_failures(statuses).items():
            errors.setdefault(n, P2PWeightsError(why))
    return errors
