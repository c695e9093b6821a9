"""The receiver's record of its engine's weight-update session: who owns it, the owner's lease, and
whether the engine's weights are torn (docs/protocol.md, "Sessions: owner and lease").

A session belongs to the controller whose ``begin_weight_update`` opened it: its owner id is the
``X-P2PW-Session-Owner`` header (``protocol.SESSION_OWNER_HEADER``) every call of that controller
carries; a call without it comes from the anonymous owner (sglang's own clients: all one
controller, as in sglang). While the owner's session is live, every other controller's pause,
begin, end, version, continue and broadcast call is refused with 409 (``SessionConflict``, naming
the owner and the session's age) before it changes anything.

The owner renews its lease (``POST /renew_weight_update``; any call of the owner renews it too).
A session whose owner stops renewing for ``lease`` seconds expires. The receiver cannot see the
one-sided writes, so it takes the safe view: **every session opened by begin may have received
writes**. An expired session, or one its owner gave up (``release``), therefore leaves the engine
paused and its weights torn: ``/health`` and ``/server_info`` say so, and continue, version, end
and broadcast writes answer 409 (``TornWeights``) until a complete update ends: the next
controller's begin takes the session over, and its end (every write landed) clears the mark.
Expiry is evaluated on every call, so what the engine answers is always up to date.
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from enum import Enum
from typing import Any, Callable

from ..control import protocol as p
from ..errors import InvalidRequest, SessionConflict, TornWeights
from ..settings import value as setting

logger = logging.getLogger(__name__)

ANONYMOUS = ""  # the owner of calls that carry no owner header


class SessionState(str, Enum):
    """The engine's weight-update session, as ``/server_info`` ``p2pw_weight_update.state`` and
    ``/health`` report it. A ``str`` enum: it equals its value, so the JSON stays the same."""

    NONE = "none"    # no session: the engine generates (or is merely paused)
    OPEN = "open"    # an owner holds it (maybe healing torn weights: see ``torn``)
    TORN = p.TORN    # no owner holds it (expired, given up): the weights may be partly written

    def __str__(self) -> str:
        return self.value

#: verbs a torn engine still accepts: pausing, taking the session over (begin), and joining or
#: leaving a broadcast group (neither touches the weights)
TORN_ALLOWS = frozenset({"pause_generation", "begin_weight_update", "init_weights_update_group",
                         "destroy_weights_update_group"})


def owner_of(headers: Any) -> str:
    """The owner id a request carries (``ANONYMOUS`` without the header)."""
    return (headers.get(p.SESSION_OWNER_HEADER) or ANONYMOUS).strip()


def lease_of(headers: Any) -> float | None:
    """The lease (seconds) a request asks for, or None; a bad value is an InvalidRequest (400)."""
    raw = headers.get(p.SESSION_LEASE_HEADER)
    if raw is None:
        return None
    try:
        lease = float(raw)
    except ValueError:
        lease = float("nan")
    if not lease > 0:
        raise InvalidRequest(f"header {p.SESSION_LEASE_HEADER} must be a number of seconds > 0, got {raw!r}")
    return lease


class SessionKeeper:
    """One engine's weight-update session as seen by its owner rules (thread-safe; the server calls
    the checks while it holds its control lock, so a check and the state change it allows are one
    step). ``lease``: the default lease in seconds (``P2PW_SESSION_LEASE``) when begin asks none."""

    def __init__(self, engine: str = "engine", lease: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.default_lease = float(setting("P2PW_SESSION_LEASE", lease))
        self._clock = clock
        self._lock = threading.Lock()
        self.open = False                 # begin ... end
        self.owner: str | None = None     # None while open: the owner is gone (expired, released)
        self.lease = self.default_lease
        self.opened_at = self.renewed_at = 0.0
        self.torn: str | None = None      # why the weights are torn

    # ---- what the engine says about itself ----------------------------------------------------
    def state(self) -> dict:
        """``{"state": SessionState, "owner", "age_s", "lease_s", "torn": why or None}``."""
        with self._lock:
            self._expire()
            if not self.open:
                return {"state": SessionState.NONE}
            now = self._clock()
            return {"state": SessionState.OPEN if self.owner is not None else SessionState.TORN, "owner": self.owner,
                    "age_s": round(now - self.opened_at, 3), "lease_s": self.lease, "torn": self.torn}

    def health(self) -> dict | None:
        """The body of ``/health``: None (sglang's empty body) unless a session is open or torn."""
        state = self.state()
        if state["state"] is SessionState.NONE:
            return None
        if state["torn"]:
            return {"status": p.TORN, "message": f"engine {self.engine}: weights are {p.TORN}: {state['torn']}",
                    "weight_update": state}
        return {"status": "updating", "weight_update": state}

    # ---- the checks -----------------------------------------------------------------------------
    def check(self, verb: str, owner: str) -> None:
        """Refuse ``verb`` from ``owner`` (409) while another owner's session is live, and any verb a
        torn engine does not accept (``TORN_ALLOWS``) while its session has no owner."""
        with self._lock:
            self._expire()
            if not self.open:
                return
            if self.owner is None:
                if verb not in TORN_ALLOWS:
                    raise TornWeights(f"{verb} refused: engine {self.engine}'s weights are {p.TORN}: {self.torn}. "
                                      f"A complete update heals them (begin_weight_update takes the session "
                                      f"over; then every write, end, version, continue)")
                return
            if owner != self.owner:
                raise SessionConflict(f"{verb} refused: engine {self.engine}'s weight-update session belongs to "
                                      f"{self._who()}")
            self.renewed_at = self._clock()  # every call of the owner renews its lease

    # ---- the session's life ---------------------------------------------------------------------
    def begin(self, owner: str, lease: float | None) -> bool:
        """Record ``owner``'s session (after ``check``); True when it took over a torn session."""
        with self._lock:
            took_over = self.open and self.owner is None
            now = self._clock()
            self.open, self.owner, self.lease = True, owner, lease or self.default_lease
            self.renewed_at = now
            if not took_over:
                self.opened_at = now
            if took_over:
                logger.warning("engine %s: %s took over a torn weight-update session (%s)", self.engine,
                               _name(owner), self.torn)
            return took_over

    def renew(self, lease: float | None) -> float:
        """The owner renewed (after ``check``); the lease it now has."""
        with self._lock:
            self.renewed_at = self._clock()
            if lease:
                self.lease = lease
            return self.lease

    def release(self, owner: str) -> None:
        """The owner gave the session up after it may have written: torn until a complete update."""
        with self._lock:
            if self.open and self.owner == owner:
                self.owner = None
                self.torn = (f"the update of {_name(owner)} was given up by its owner after its writes began; "
                             f"the weights may be partly written")
                logger.warning("engine %s: %s", self.engine, self.torn)

    def end(self) -> None:
        """The owner ended the session (every write landed; the engine post-processed): not torn."""
        with self._lock:
            self.open, self.owner, self.torn = False, None, None

    # ---- inside the lock ------------------------------------------------------------------------
    def _expire(self) -> None:
        if not self.open or self.owner is None:
            return
        now = self._clock()
        silent = now - self.renewed_at
        if silent <= self.lease:
            return
        self.torn = (f"the weight-update session of {_name(self.owner)} expired: its owner did not renew it "
                     f"for {silent:.1f}s (lease {self.lease:g}s, opened {now - self.opened_at:.1f}s ago); "
                     f"writes may have landed")
        logger.warning("engine %s: %s", self.engine, self.torn)
        self.owner = None

    def _who(self) -> str:
        now = self._clock()
        return (f"{_name(self.owner)} (opened {now - self.opened_at:.1f}s ago, last renewed "
                f"{now - self.renewed_at:.1f}s ago, lease {self.lease:g}s)")


def _name(owner: str | None) -> str:
    return f"owner {owner!r}" if owner else "the anonymous owner (calls without an owner header)"


# ---- the server's side: one call through the owner rules ---------------------------------------

#: the verbs the owner rules govern; the others (reading, checks, publications) are anyone's
GATED = frozenset({"pause_generation", "continue_generation", "begin_weight_update", "end_weight_update",
                   "update_weight_version", "update_weights_from_distributed", "init_weights_update_group",
                   "destroy_weights_update_group", "renew_weight_update"})
#: gated verbs that run outside the server's control lock: joining a group waits for every member;
#: a renewal must get through while the owner's own end_weight_update holds the lock
UNLOCKED = frozenset({"init_weights_update_group", "destroy_weights_update_group", "renew_weight_update"})


def gated(server: Any, verb: str, headers: Any, call: Callable[[], tuple[int, Any]]) -> tuple[int, Any]:
    """Run one call of ``verb`` (``call`` -> (status, answer)) under ``server.session``'s owner
    rules: the check and the call are one step under the server's control lock (a reentrant lock:
    the verb takes it again); a begin or end that succeeded is recorded, and begin answers the
    owner's ``lease``."""
    if verb not in GATED:
        return call()
    owner, lease = owner_of(headers), lease_of(headers)
    lock = server._control_lock if verb not in UNLOCKED else contextlib.nullcontext()
    with lock:
        server.session.check(verb, owner)
        status, answer = call()
        if p.ok(status) and verb == "begin_weight_update":
            took_over = server.session.begin(owner, lease)
            answer = {**answer, "lease": server.session.lease, "took_over": took_over}
        elif p.ok(status) and verb == "end_weight_update":
            server.session.end()
    return status, answer


def renew(server: Any, release: bool, headers: Any) -> dict:
    """``POST /renew_weight_update`` (its owner was checked by :func:`gated`): renew the lease and
    check the engine's ranks answer (``hooks.on_renew_lease``), or give the session up."""
    owner, lease = owner_of(headers), lease_of(headers)
    if not server.session.open:
        raise InvalidRequest(f"{p.NO_SESSION} is open on this engine: nothing to renew")
    if release:
        server.session.release(owner)
        return {"success": True, "message": f"session released: the weights are {p.TORN} until a complete update"}
    lease = server.session.renew(lease)
    server.hooks.on_renew_lease()  # a stalled rank is named here, within the renewal's timeout
    return {"success": True, "message": "lease renewed", "lease": lease}
