"""Deltas applied beside the writes: an engine rank applies a slot's records while later slots are
still written, so the apply left after the last write is one slot's, not the whole update's.

Every sender seals its delta targets' records per transfer slot (``AppliesBeside.seal``): the
sender that holds the session, and a group's other senders under the owner token sender 0 hands
them at the opened step (over the trainer's own process group; the engine sees one owner). Once
every write of a slot returned (the writer counts none still reading it), its sealed segments go to
their engine in one ``p2pw_apply_deltas`` call on a worker thread, at most one call in flight per
engine and sender; the
engine core applies each area byte at most once per session (engine/core.py, rule 5). What is
still sealed or open at the end goes in the end body, as before. A refused apply tears that engine
(core rule 4): :meth:`AppliesBeside.drain` names it among the update's failures, and it is not ended.

``P2PW_DELTA_APPLY_BESIDE=0`` turns it off (every record applied at the end, one call per engine).
"""
from __future__ import annotations

import concurrent.futures as futures
import logging
import time
from typing import Any, Callable, Iterable, Sequence

from ..deltas.area import segments_wire
from ..settings import value as setting

logger = logging.getLogger("p2pweights.sender")

#: segments of one rank sealed and not yet applied at most (the rest grow the open one): an end names
#: at most this many plus one per writer, under deltas/area.py's MAX_SEGMENTS
SEALED_MOST = 256


def offer(session: Any) -> tuple[str, str] | None:
    """What the session's holder tells its group at the opened step: its owner (token, label), so the
    other senders apply their own records beside their writes; None when it does not apply beside."""
    return (session.owner, session.owner_label) if session is not None and setting("P2PW_DELTA_APPLY_BESIDE") \
        else None


def start(update_deltas: Any, session: Any, writer: Any, engines: Sequence[Any], handover: Any, pipeline: Any,
          statuses: Sequence[Any] = ()) -> "AppliesBeside | None":
    """The applies beside an update's writes, hooked into its pipeline and hand-over: for the sender
    holding ``session``, or another sender of its group under the owner sender 0 offered (``statuses``
    of the opened step), with ``P2PW_DELTA_APPLY_BESIDE`` on and a target taking deltas."""
    owner = None if session is not None else next((s.owner for s in statuses if s.owner), None)
    if not ((session is not None or owner) and update_deltas is not None and setting("P2PW_DELTA_APPLY_BESIDE")
            and any(x.delta for x in update_deltas.targets.values())):
        return None
    beside = AppliesBeside(update_deltas, writer, engines, owner)
    handover.beside = pipeline.beside = beside
    return beside


def finish(beside: "AppliesBeside | None", handover: Any, pipeline: Any) -> dict[str, str]:
    """Every apply beside the writes returned (the pool closed): the engines whose apply failed."""
    if beside is None:
        return {}
    handover.beside = pipeline.beside = None
    try:
        return beside.drain()
    finally:
        beside.close()


def returned(targets: Iterable[Any], done: Callable[[int], bool], busy: Any = ()) -> dict[str, dict[str, list]]:
    """The sealed segments whose slots' writes all returned (``done(slot)``), taken, but for the
    engines ``busy``: ``{engine: {rank: [manifest, ...]}}``."""
    out: dict[str, dict[str, list]] = {}
    for x in targets:
        if x.delta and x.sealed and x.t.engine.name not in busy and (segments := x.take(done)):
            out.setdefault(x.t.engine.name, {})[str(x.t.rank)] = [m.manifest() for m in segments]
    return out


class AppliesBeside:
    """One update's applies beside its writes (see the module): ``poll`` after each slot reaches the
    writer, ``drain`` once every write returned (before the end)."""

    def __init__(self, deltas: Any, writer: Any, engines: Sequence[Any], owner: tuple[str, str] | None = None):
        self.deltas, self.writer = deltas, writer
        self.engines = {e.name: e for e in engines}
        self._owner = owner  # a group's other sender: its calls carry sender 0's owner (cleared at close)
        if owner is not None:
            for e in engines:
                e.session_owner, e.session_label = owner
        self.calls = self.segments = 0  # p2pw_apply_deltas calls that succeeded, the segments they named
        self.seconds = 0.0  # those calls' time, summed
        self._pool = futures.ThreadPoolExecutor(max_workers=max(1, min(len(engines), 8)),
                                                thread_name_prefix="p2pw-apply")
        self._inflight: dict[str, tuple[futures.Future, list[str]]] = {}  # engine -> (its call, its ranks)
        self.failures: dict[str, str] = {}  # "engine/rankN" -> why its apply failed
        self._torn: set[str] = set()  # engines whose apply failed: they get no more calls

    def seal(self, slot: int) -> None:
        """Every delta target's records of the slot just closed (transfer slot ``slot``): sealed."""
        for x in self.deltas.targets.values():
            if x.delta:
                x.seal(slot, SEALED_MOST)

    def submitted(self, slot: int) -> None:
        """Transfer slot ``slot`` reached the writer (its sealed segments may go once it returns); then
        what returned meanwhile is applied."""
        for x in self.deltas.targets.values():
            x.submitted(slot)
        self.poll()

    def poll(self) -> None:
        """Send each engine not busy its segments whose writes returned."""
        self._reap(block=False)
        busy = {*self._inflight, *self._torn}  # one call per engine at a time; a torn one gets none
        for name, ranks in returned(self.deltas.targets.values(), self._returned, busy).items():
            self._inflight[name] = (self._pool.submit(self._apply, name, ranks), list(ranks))

    def drain(self) -> dict[str, str]:
        """Wait for every call in flight (after the writer finished: nothing more returns); the engine
        ranks whose apply failed (``"engine/rankN"``, as the writer names a rank whose writes failed, so
        ``on_engine_down="skip"`` leaves such an engine out alike), with why. What was not sent stays for
        the end body."""
        self._reap(block=True)
        return dict(self.failures)

    def close(self) -> None:
        self._reap(block=True)
        self._pool.shutdown(wait=True)
        if self._owner is not None:
            for e in self.engines.values():
                if e.session_owner == self._owner[0]:
                    e.session_owner = e.session_label = None

    def _returned(self, slot: int) -> bool:
        return self.writer.pending_batches(slot) == 0

    def _apply(self, name: str, ranks: dict[str, list]) -> tuple[int, float]:
        t0 = time.perf_counter()
        self.engines[name].p2pw_apply_deltas({rank: segments_wire(ms) for rank, ms in ranks.items()})
        return sum(len(ms) for ms in ranks.values()), time.perf_counter() - t0

    def _reap(self, block: bool) -> None:
        for name, (fut, ranks) in list(self._inflight.items()):
            if not block and not fut.done():
                continue
            del self._inflight[name]
            try:
                segments, seconds = fut.result()
            except Exception as e:  # noqa: BLE001 - the engine is torn: the update fails on it, no end
                why = f"applying its delta records beside the writes failed: {type(e).__name__}: {e}"
                self._torn.add(name)
                self.failures.update({f"{name}/rank{rank}": why for rank in ranks})
                logger.error("engine %s: %s", name, why)
                continue
            self.calls, self.segments, self.seconds = self.calls + 1, self.segments + segments, self.seconds + seconds

    def figures(self) -> dict:
        """The update report's fields."""
        return {"segments_applied_beside": self.segments, "apply_calls_beside": self.calls,
                "apply_beside_seconds": round(self.seconds, 6)}
