"""The owner's side of a weight-update session (docs/protocol.md, "Sessions: owner and lease"):
an owner id per controller, this process's claims on engines, and the lease renewal.

- :func:`new_owner_id`: a controller's id (host, pid and a random part: readable in the error a
  refused controller gets). ``UpdateSession`` sends it on every call (``SglangEngine.session_owner``).
- :class:`Claims`: one process never runs two sessions on one engine (an engine's URL), whatever
  the engine: the check that works against real sglang servers too, which know no owners.
- :class:`LeaseRenewer`: while the session is open, a thread renews the lease of every engine that
  keeps one (a receiver's begin answers ``lease``; sglang's does not) every third of it; just
  before ending, :meth:`LeaseRenewer.check_in` renews once more with a short timeout, which also
  makes the engine's leader ping every rank, so a stalled rank is named in seconds.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from typing import Any, Callable, Iterable, Sequence

from ..errors import EngineUnreachable, SessionConflict

logger = logging.getLogger(__name__)


def new_owner_id() -> str:
    """``host:pid:random``: unique per controller, and says where it runs."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Claims:
    """Which engines (by URL) an open session of this process holds, and its owner."""

    def __init__(self) -> None:
        self._held: dict[str, str] = {}
        self._lock = threading.Lock()

    def claim(self, engines: Iterable[Any], owner: str) -> None:
        """Claim every engine for ``owner`` or none: SessionConflict naming the engine and the owner
        already holding it (nothing was sent to any engine)."""
        engines = list(engines)
        with self._lock:
            for e in engines:
                holder = self._held.get(e.base_url)
                if holder is not None and holder != owner:
                    raise SessionConflict(
                        f"engine {e.name} ({e.base_url}): another update of this process (owner {holder!r}) "
                        f"has its weight-update session open; refused before anything was sent",
                        engine=e.name, hint="finish that update (leave its with block, or finish()) before "
                                            "the next one")
            for e in engines:
                self._held[e.base_url] = owner

    def release(self, engines: Iterable[Any], owner: str) -> None:
        with self._lock:
            for e in engines:
                if self._held.get(e.base_url) == owner:
                    del self._held[e.base_url]


#: this process's claims (one per process: a claim is about the process, not an object)
CLAIMS = Claims()


def check_in_timeout(engine: Any) -> float:
    """How long a check-in may take: the leader pings its ranks within its connect timeout
    (``rank_server.ping_timeout``), so a few of ours, bounded by the call timeout."""
    return min(float(engine.timeout), 3 * float(engine.connect_timeout) + 1.0)


class LeaseRenewer:
    """Renews ``owner``'s lease on the engines that keep one. ``call(engines, fn)`` runs ``fn`` on
    every engine at once and returns an ``EngineCalls`` (control.engine_calls.call_engines)."""

    def __init__(self, lease: float, call: Callable[..., Any]):
        self.lease = float(lease)
        self.leased: dict[str, Any] = {}            # engine name -> engine, for engines that keep a lease
        self.lost: dict[str, BaseException] = {}    # engine name -> why its last renewal failed
        self._call = call
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def keep(self, engine: Any, answered_lease: float) -> None:
        """``engine`` keeps a lease (its begin answered ``answered_lease``): renew it."""
        with self._lock:
            self.leased[engine.name] = engine
            self.lease = min(self.lease, float(answered_lease))

    def forget(self, engine: Any) -> None:
        """``engine``'s session ended: no more renewals of it."""
        with self._lock:
            self.leased.pop(engine.name, None)

    def start(self) -> None:
        if self.leased and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="p2pw-lease", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """No more renewals (a renewal in flight ends by itself, within its timeout: not waited for)."""
        self._stop.set()

    def check_in(self, engines: Sequence[Any]) -> dict[str, BaseException]:
        """Renew once, now, with a short timeout, on those of ``engines`` that keep a lease: name ->
        error for each that did not answer, refused (lost its session), or has a rank that does not
        answer its leader."""
        def renew_weight_update(e: Any) -> Any:  # named: call_engines labels its threads and logs by it
            return e.renew_weight_update(lease=self.lease, timeout=check_in_timeout(e))

        errors = dict(self._call([e for e in engines if e.name in self.leased], renew_weight_update).errors)
        for name, err in errors.items():
            if isinstance(err, EngineUnreachable) and err.rank is None:  # the leader itself is silent
                errors[name] = EngineUnreachable(f"{err.message} (its leader, engine rank 0, does not answer)",
                                                 engine=name, rank=0, hint=err.hint)
        return errors

    def release(self, engines: Sequence[Any]) -> dict[str, BaseException]:
        """Give the session up on those of ``engines`` that keep a lease (their weights are then torn
        until a complete update); errors are returned, never raised."""
        def release_weight_update(e: Any) -> Any:
            return e.renew_weight_update(release=True, timeout=check_in_timeout(e))

        return dict(self._call([e for e in engines if e.name in self.leased], release_weight_update).errors)

    def _loop(self) -> None:
        while not self._stop.wait(self.lease / 3):
            errors = self.check_in(list(self.leased.values()))
            if self._stop.is_set():  # the session ended meanwhile: nothing left to renew
                return
            for name in list(self.leased):  # forget() may take one out meanwhile
                if name in errors:
                    if name not in self.lost:
                        logger.warning("engine %s: renewing the weight-update lease failed: %s", name, errors[name])
                    self.lost[name] = errors[name]
                else:
                    self.lost.pop(name, None)
