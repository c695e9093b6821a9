"""An engine's record of its weight-update session: who owns it, the owner's lease, and whether the
engine's weights are torn (docs/protocol.md, "Sessions: owner and lease"). The engine core
(:mod:`.core`) keeps one per engine, whichever host runs it (our receiver, the sglang plugin, the
vLLM backend).

A session belongs to the controller whose ``begin_weight_update`` opened it: its **owner token**
is the ``X-P2PW-Session-Owner`` header (``protocol.SESSION_OWNER_HEADER``) every call of that
controller carries. The token is a credential: begin refuses one shorter than ``OWNER_MIN_CHARS``
(``control.lease.new_owner_id`` makes 256-bit ones), it is compared in constant time, and no
answer, error or log line ever shows it. What the engine shows instead is a **label**: ``#N``
(the session's number on this engine) and the owner's own non-secret words
(``X-P2PW-Session-Label``, ``protocol.SESSION_LABEL_HEADER``: ``host:pid``), with how long ago the
session opened and was last renewed. A call without the owner header comes from the anonymous
owner (sglang's own clients: all one controller, as in sglang; not a credential). While the
owner's session is live, every other controller's pause, begin, end, version, continue and
broadcast call is refused with 409 (``SessionConflict``, naming the owner's label and the
session's age) before it changes anything.

The **lease** is the engine's: its ``P2PW_SESSION_LEASE`` (``ReceiverServer(session_lease=)``) is
the longest it grants. A controller may ask for a shorter one (``X-P2PW-Session-Lease``); a longer
or infinite request is capped to it; a request that is not a positive number of seconds (``nan``,
``-1``, ``abc``) is refused (400 naming the header). Begin and renew answer the lease granted.
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

import hmac
import logging
import math
import threading
import time
from enum import Enum
from typing import Any, Callable

from ..control import protocol as p
from ..errors import InvalidRequest, SessionConflict, TornWeights
from ..settings import value as setting

logger = logging.getLogger(__name__)

ANONYMOUS = ""  # the owner of calls that carry no owner header
#: the shortest owner token begin accepts: 128 bits as ``secrets.token_urlsafe(16)`` writes them
OWNER_MIN_CHARS = 22
OWNER_MAX_CHARS = 256
LABEL_MAX_CHARS = 64


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
    """The owner token a request carries (``ANONYMOUS`` without the header). Never shown."""
    return (headers.get(p.SESSION_OWNER_HEADER) or ANONYMOUS).strip()


def same_owner(a: str, b: str) -> bool:
    """Whether two owner tokens are one, compared in constant time."""
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


def check_owner_token(owner: str) -> None:
    """Refuse (400) an owner token a begin would make a guessable credential; the anonymous owner
    (no header: sglang's clients) stays allowed. The message never repeats the token."""
    if owner == ANONYMOUS:
        return
    if not (OWNER_MIN_CHARS <= len(owner) <= OWNER_MAX_CHARS and owner.isascii() and owner.isprintable()
            and " " not in owner):
        raise InvalidRequest(f"header {p.SESSION_OWNER_HEADER} must be an unguessable token of {OWNER_MIN_CHARS} to "
                             f"{OWNER_MAX_CHARS} printable ASCII characters without spaces (e.g. "
                             f"secrets.token_urlsafe(32)); got {len(owner)} characters")


def label_of(headers: Any, owner: str) -> str:
    """The owner's non-secret label (``protocol.SESSION_LABEL_HEADER``: ``host:pid``), cleaned and
    clipped; empty when absent, or when it would show the token."""
    raw = headers.get(p.SESSION_LABEL_HEADER) or ""
    label = "".join(c for c in raw if c.isascii() and c.isprintable()).strip()[:LABEL_MAX_CHARS]
    if owner and (owner in raw or (label and same_owner(label, owner))):
        return ""  # a client that sent its token as its label: never shown
    return label


def lease_of(headers: Any) -> float | None:
    """The lease (seconds) a request asks for, or None. Not a positive number of seconds (``nan``,
    ``-1``, ``0``, ``abc``): InvalidRequest (400) naming the header. ``inf`` (or ``1e309``) is a
    valid ask: the keeper caps it (:meth:`SessionKeeper.grant`)."""
    raw = headers.get(p.SESSION_LEASE_HEADER)
    if raw is None:
        return None
    try:
        lease = float(raw)
    except ValueError:
        lease = float("nan")
    if not lease > 0:  # nan too
        raise InvalidRequest(f"header {p.SESSION_LEASE_HEADER} must be a number of seconds > 0, got "
                             f"{str(raw)[:40]!r}")
    return lease


class SessionKeeper:
    """One engine's weight-update session as seen by its owner rules (thread-safe; the server calls
    the checks while it holds its control lock, so a check and the state change it allows are one
    step). ``lease``: the longest lease in seconds this engine grants (``P2PW_SESSION_LEASE``), also
    the lease of a begin that asks none; it must be finite."""

    def __init__(self, engine: str = "engine", lease: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.engine = engine
        self.max_lease = float(setting("P2PW_SESSION_LEASE", lease))
        if not (math.isfinite(self.max_lease) and self.max_lease > 0):
            raise ValueError(f"P2PW_SESSION_LEASE (the engine's longest lease) must be a finite number of "
                             f"seconds > 0, got {self.max_lease!r}")
        self._clock = clock
        self._lock = threading.Lock()
        self.open = False                 # begin ... end
        self._token: str | None = None    # the owner's secret; None while open: the owner is gone (expired, released)
        self.label = ""                   # what is shown of the owner: "#N host:pid" (never the token)
        self.sessions = 0                 # sessions begun on this engine (the N of "#N")
        self.lease = self.max_lease       # the lease granted to the owner
        self.opened_at = self.renewed_at = 0.0
        self.torn: str | None = None      # why the weights are torn
        # the registration epoch (transport/revocation.py): moves on when a takeover revokes what the
        # lost owner could still reach; begin answers it, publications carry it
        self.epoch = 1

    @property
    def lost(self) -> bool:
        """Whether a session is open that its owner lost (expired, released): a begin now takes it
        over, and its old owner may still have writes in flight."""
        with self._lock:
            self._expire()
            return self.open and self._token is None

    @property
    def held(self) -> bool:
        """Whether an owner holds the session (False when none is open, or it is torn)."""
        return self._token is not None

    def grant(self, requested: float | None) -> float:
        """The lease granted for ``requested`` seconds: at most the engine's ``max_lease`` (an infinite
        ask is capped too); ``max_lease`` when nothing was asked."""
        if requested is None or not requested > 0:  # lease_of refuses those; None and nan: the maximum
            return self.max_lease
        return min(float(requested), self.max_lease)

    # ---- what the engine says about itself ----------------------------------------------------
    def state(self) -> dict:
        """``{"state": SessionState, "owner": label or None, "age_s", "renewed_s", "lease_s",
        "lease_max_s", "torn": why or None}`` (``owner``: the label, never the token)."""
        with self._lock:
            self._expire()
            if not self.open:
                return {"state": SessionState.NONE, "epoch": self.epoch}
            now = self._clock()
            return {"state": SessionState.OPEN if self.held else SessionState.TORN, "epoch": self.epoch,
                    "owner": self.label if self.held else None,
                    "age_s": round(now - self.opened_at, 3), "renewed_s": round(now - self.renewed_at, 3),
                    "lease_s": self.lease, "lease_max_s": self.max_lease, "torn": self.torn}

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
            if self._token is None:
                if verb not in TORN_ALLOWS:
                    raise TornWeights(f"{verb} refused: engine {self.engine}'s weights are {p.TORN}: {self.torn}. "
                                      f"A complete update heals them (begin_weight_update takes the session "
                                      f"over; then every write, end, version, continue)")
                return
            if not same_owner(owner, self._token):
                raise SessionConflict(f"{verb} refused: engine {self.engine}'s weight-update session belongs to "
                                      f"{self._who()}")
            self.renewed_at = self._clock()  # every call of the owner renews its lease

    # ---- the session's life ---------------------------------------------------------------------
    def begin(self, owner: str, lease: float | None, label: str = "") -> bool:
        """Record ``owner``'s session (after ``check``) with the lease :meth:`grant` gives ``lease``;
        ``label`` is what is shown of it. True when it took over a torn session."""
        with self._lock:
            took_over = self.open and self._token is None
            now = self._clock()
            self.sessions += 1
            self.open, self._token, self.lease = True, owner, self.grant(lease)
            self.label = f"#{self.sessions} {label}" if label else f"#{self.sessions}"
            if owner == ANONYMOUS:
                self.label += " (anonymous: calls without an owner header)"
            self.renewed_at = now
            if not took_over:
                self.opened_at = now
            if took_over:
                logger.warning("engine %s: %s took over a torn weight-update session (%s)", self.engine,
                               self._name(), self.torn)
            return took_over

    def renew(self, lease: float | None) -> float:
        """The owner renewed (after ``check``); the lease it now has (:meth:`grant`)."""
        with self._lock:
            self.renewed_at = self._clock()
            if lease is not None:
                self.lease = self.grant(lease)
            return self.lease

    def release(self, owner: str) -> None:
        """The owner gave the session up after it may have written: torn until a complete update."""
        with self._lock:
            if self.open and self._token is not None and same_owner(owner, self._token):
                self._token = None
                self.torn = (f"the update of {self._name()} was given up by its owner after its writes began; "
                             f"the weights may be partly written")
                logger.warning("engine %s: %s", self.engine, self.torn)

    def tear(self, why: str) -> None:
        """The weights may be partly written and this session can no longer commit them (the engine
        core's tear rule, ``core.py``): no owner holds it from now on; torn until a complete update."""
        with self._lock:
            if self.open:
                self._token, self.torn = None, why
                logger.warning("engine %s: torn: %s", self.engine, why)

    def end(self) -> None:
        """The owner ended the session (every write landed; the engine post-processed): not torn."""
        with self._lock:
            self.open, self._token, self.torn = False, None, None

    # ---- inside the lock ------------------------------------------------------------------------
    def _expire(self) -> None:
        if not self.open or self._token is None:
            return
        now = self._clock()
        silent = now - self.renewed_at
        if silent <= self.lease:
            return
        self.torn = (f"the weight-update session of {self._name()} expired: its owner did not renew it "
                     f"for {silent:.1f}s (lease {self.lease:g}s, opened {now - self.opened_at:.1f}s ago); "
                     f"writes may have landed")
        logger.warning("engine %s: %s", self.engine, self.torn)
        self._token = None

    def _name(self) -> str:
        return f"owner {self.label}"

    def _who(self) -> str:
        now = self._clock()
        return (f"{self._name()} (opened {now - self.opened_at:.1f}s ago, last renewed "
                f"{now - self.renewed_at:.1f}s ago, lease {self.lease:g}s)")
