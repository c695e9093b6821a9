"""The owner's side of a weight-update session (docs/protocol.md, "Sessions: owner and lease"):
an owner token per controller, this process's claims on engines, and the lease renewal.

- :func:`new_owner_id`: a controller's owner token, 256 random bits (``secrets.token_urlsafe``): a
  credential, sent only in the owner header of its own calls and never shown (logs and errors
  show :func:`owner_label`, ``host:pid``, which the receiver shows too, numbered per session).
  ``UpdateSession`` sends both on every call (``SglangEngine.session_owner`` / ``session_label``).
- :class:`Claims`: one process never runs two sessions on one engine (an engine's URL), whatever
  the engine: the check that works against real sglang servers too, which know no owners.
- :class:`LeaseRenewer`: while the session is open, a thread renews the lease of every engine that
  keeps one (a receiver's begin answers the ``lease`` it granted, at most its own
  ``P2PW_SESSION_LEASE``; sglang's answers none) every third of the shortest granted; just before
  ending, :meth:`LeaseRenewer.check_in` renews once more with a short timeout, which also makes the
  engine's leader ping every rank, so a stalled rank is named in seconds.
  :meth:`LeaseRenewer.deadline` says until when (``time.monotonic()``) this owner may still post
  writes: the send time of each engine's last successful renewal plus its granted lease, less a
  margin; never once an engine refused a renewal or the session was given up.
"""
from __future__ import annotations

import hmac
import logging
import math
import os
import secrets
import socket
import threading
import time
from typing import Any, Callable, Iterable, Sequence

from ..errors import EngineUnreachable, SessionConflict, TornWeights
from . import protocol as p

logger = logging.getLogger(__name__)

#: the part of a granted lease :meth:`LeaseRenewer.deadline` keeps back: posts stop this much before
#: the engine could expire the session (its clock starts when it receives the renewal, after we sent it)
DEADLINE_MARGIN = 0.1


def new_owner_id() -> str:
    """A new owner token: 256 random bits, URL-safe (43 characters). A secret: never log or show it
    (show :func:`owner_label`)."""
    return secrets.token_urlsafe(32)


def owner_label() -> str:
    """What this process shows of its owners, to engines, logs and errors: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


class Claims:
    """Which engines (by URL) an open session of this process holds, and its owner (a token, never
    shown: the refusal says how long ago the holder claimed the engine)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[str, float]] = {}  # URL -> (owner token, monotonic time of the claim)
        self._lock = threading.Lock()

    def claim(self, engines: Iterable[Any], owner: str) -> None:
        """Claim every engine for ``owner`` or none: SessionConflict naming the engine (nothing was
        sent to any engine)."""
        engines = list(engines)
        with self._lock:
            for e in engines:
                holder = self._held.get(e.base_url)
                if holder is not None and not _same(holder[0], owner):
                    raise SessionConflict(
                        f"engine {e.name} ({e.base_url}): another update of this process ({owner_label()}, "
                        f"claimed {time.monotonic() - holder[1]:.1f}s ago) has its weight-update session open; "
                        f"refused before anything was sent",
                        engine=e.name, hint="finish that update (leave its with block, or finish()) before "
                                            "the next one")
            now = time.monotonic()
            for e in engines:
                self._held[e.base_url] = (owner, now)

    def release(self, engines: Iterable[Any], owner: str) -> None:
        with self._lock:
            for e in engines:
                holder = self._held.get(e.base_url)
                if holder is not None and _same(holder[0], owner):
                    del self._held[e.base_url]


def _same(a: str, b: str) -> bool:
    """Two owner tokens are one (constant time)."""
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


#: this process's claims (one per process: a claim is about the process, not an object)
CLAIMS = Claims()


def check_in_timeout(engine: Any) -> float:
    """How long a check-in may take: the leader pings its ranks within its connect timeout
    (``rank_server.ping_timeout``), so a few of ours, bounded by the call timeout."""
    return min(float(engine.timeout), 3 * float(engine.connect_timeout) + 1.0)


class LeaseRenewer:
    """Renews ``owner``'s lease on the engines that keep one. ``call(engines, fn)`` runs ``fn`` on
    every engine at once and returns an ``EngineCalls`` (control.engine_calls.call_engines).

    ``lease`` is what the owner asks for; each engine grants at most its own maximum, and the
    renewals run every third of the shortest lease granted (``self.lease``). Per engine it keeps the
    lease granted (``granted``) and the ``time.monotonic()`` at which its last successful begin or
    renewal was **sent** (``renewed_at``): the engine started its lease no earlier, so
    :meth:`deadline` never outlives the engine's view of the session."""

    def __init__(self, lease: float, call: Callable[..., Any], margin: float = DEADLINE_MARGIN):
        self.lease = float(lease)
        self.margin = float(margin)
        self.leased: dict[str, Any] = {}            # engine name -> engine, for engines that keep a lease
        self.lost: dict[str, BaseException] = {}    # engine name -> why its last renewal failed
        self.granted: dict[str, float] = {}         # engine name -> the lease it granted (seconds)
        self.renewed_at: dict[str, float] = {}      # engine name -> monotonic send time of its last good renewal
        self.revoked: set[str] = set()              # engines whose session this owner lost (409) or gave up
        self._call = call
        self._stop = threading.Event()
        self._over = False                          # stop(): the session is over for this owner
        #: called (engine name, its new deadline) after a begin or renewal succeeded (the deadline moved
        #: on) and when the engine's session is lost or given up (-inf); outside the lock, on the thread
        #: that learned it. The writer's fence (``PipelinedWriter.fence``) hangs here.
        self.on_deadline: Callable[[str, float], None] | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def keep(self, engine: Any, answered_lease: float, sent_at: float | None = None) -> None:
        """``engine`` keeps a lease (its begin, sent at ``sent_at`` (``time.monotonic()``; default:
        now), answered ``answered_lease``, the lease it granted): renew it. An answer that is not a
        positive finite number of seconds is not a lease: the engine is not renewed."""
        lease = _granted(answered_lease)
        if lease is None:
            logger.warning("engine %s: its begin answered lease %r, not a number of seconds > 0: not renewed",
                           engine.name, answered_lease)
            return
        with self._lock:
            self.leased[engine.name] = engine
            self.granted[engine.name] = lease
            self.renewed_at[engine.name] = time.monotonic() if sent_at is None else float(sent_at)
            self.revoked.discard(engine.name)
            self.lease = min(self.lease, lease)
        self._tell(engine.name)

    def forget(self, engine: Any) -> None:
        """``engine``'s session ended: no more renewals of it."""
        with self._lock:
            self.leased.pop(engine.name, None)

    def deadline(self, engine: str | None = None) -> float:
        """Until when (``time.monotonic()`` seconds) this owner may still post writes to ``engine`` (a
        name; default: to every engine it holds, the earliest): the send time of the engine's last
        successful begin or renewal + the lease it granted × (1 - ``margin``); ``inf`` for an engine
        that keeps no lease. ``-inf`` once an engine refused a renewal
        (409: the session is another's, or torn) or the session was given up there, and once
        :meth:`stop` ended the renewals (the session is over: committed, aborted or rolled back);
        ``inf`` while no engine keeps a lease (sglang's servers expire nothing). Thread-safe and cheap:
        a writer may ask before every post."""
        with self._lock:
            if self._over:
                return -math.inf
            deadline = math.inf
            for name in self.leased if engine is None else [engine] if engine in self.leased else []:
                if name in self.revoked:
                    return -math.inf
                deadline = min(deadline, self.renewed_at[name] + self.granted[name] * (1.0 - self.margin))
            return deadline

    def _tell(self, name: str) -> None:
        if self.on_deadline is not None:
            self.on_deadline(name, self.deadline(name))

    def start(self) -> None:
        if self.leased and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="p2pw-lease", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """No more renewals (a renewal in flight ends by itself, within its timeout: not waited for); the
        session is over for this owner: :meth:`deadline` says ``-inf`` from now on."""
        with self._lock:
            self._over = True
        self._stop.set()

    def check_in(self, engines: Sequence[Any]) -> dict[str, BaseException]:
        """Renew once, now, with a short timeout, on those of ``engines`` that keep a lease: name ->
        error for each that did not answer, refused (lost its session), or has a rank that does not
        answer its leader. A renewal that succeeded moves that engine's :meth:`deadline` on; one the
        engine refused because the session is not this owner's any more (409 ``SessionConflict`` or
        ``TornWeights``; 400 no session: taken over and ended) ends it (``revoked``)."""
        def renew_weight_update(e: Any) -> Any:  # named: call_engines labels its threads and logs by it
            sent_at = time.monotonic()
            try:
                answer = e.renew_weight_update(lease=self.lease, timeout=check_in_timeout(e))
            except Exception as err:  # re-raised: call_engines records it
                if _session_lost(err):
                    with self._lock:
                        self.revoked.add(e.name)
                    self._tell(e.name)
                raise
            lease = _granted(answer.get("lease")) if isinstance(answer, dict) else None
            with self._lock:
                if e.name in self.leased and e.name not in self.revoked:
                    self.renewed_at[e.name] = max(self.renewed_at.get(e.name, sent_at), sent_at)
                    if lease is not None:
                        self.granted[e.name] = lease
                        self.lease = min(self.lease, lease)
            self._tell(e.name)
            return answer

        errors = dict(self._call([e for e in engines if e.name in self.leased], renew_weight_update).errors)
        for name, err in errors.items():
            if isinstance(err, EngineUnreachable) and err.rank is None:  # the leader itself is silent
                errors[name] = EngineUnreachable(f"{err.message} (its leader, engine rank 0, does not answer)",
                                                 engine=name, rank=0, hint=err.hint)
        return errors

    def release(self, engines: Sequence[Any]) -> dict[str, BaseException]:
        """Give the session up on those of ``engines`` that keep a lease (their weights are then torn
        until a complete update); errors are returned, never raised. From now on :meth:`deadline`
        says ``-inf``."""
        def release_weight_update(e: Any) -> Any:
            return e.renew_weight_update(release=True, timeout=check_in_timeout(e))

        leased = [e for e in engines if e.name in self.leased]
        with self._lock:
            self.revoked.update(e.name for e in leased)  # before the call: no post after giving up
        for e in leased:
            self._tell(e.name)
        return dict(self._call(leased, release_weight_update).errors)

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


def _session_lost(err: BaseException) -> bool:
    """Whether a renewal's error says the engine holds no session of this owner any more."""
    return isinstance(err, (SessionConflict, TornWeights)) or (
        not isinstance(err, EngineUnreachable) and p.NO_SESSION in str(err) and f"HTTP {p.BAD_REQUEST}" in str(err))


def _granted(answered: Any) -> float | None:
    """A lease an engine answered, when it is a positive finite number of seconds; else None."""
    if isinstance(answered, bool):
        return None
    try:
        lease = float(answered)
    except (TypeError, ValueError):
        return None
    return lease if math.isfinite(lease) and lease > 0 else None
