"""The client side of one weight update on many engines: ``UpdateSession`` (the control plane of
the update) and ``FailurePolicy`` (what becomes of the engines when it fails).

One update, seen from the control plane (``UpdateSession`` does exactly this, on many engines at
once, through ``engine_calls.call_engines``)::

    pause_generation -> begin_weight_update -> (the one-sided writes) ->
        end_weight_update -> update_weight_version(abort_all_requests=false) -> continue_generation

Engines end the update and bump their version only after every write succeeded (DESIGN invariant
3); an engine whose update failed: see ``UpdateSession``. Failures are raised as one ``EnginesFailed``
(``UpdateFailed`` and ``EngineError``) naming each failed engine; ``.engine`` / ``.rank``: the first.

A session has an owner (docs/protocol.md, "Sessions: owner and lease"): every ``UpdateSession`` is
a controller with its own owner token (``control.lease``: a secret, never logged) and label
(``host:pid``), sent on every call; a receiver refuses other controllers' calls while the session
is live (``SessionConflict``), and the owner renews the lease the engine granted while it writes
(:meth:`UpdateSession.lease_deadline`: until when it may still post). The engine's side: the engine core.
"""
from __future__ import annotations

import logging
import threading
import time
from enum import Enum
from typing import Any, Callable, Iterable

from ..errors import EngineError, SessionConflict, UpdateRefused
from ..settings import value as setting
from . import protocol as p
from .engine_calls import EngineCalls, call_engines, check_unique_names, engines_failed, verb_log
from .folds import PAUSE_IN_BEGIN, StepFailed, end_folded
from .lease import CLAIMS, LeaseRenewer, new_owner_id, owner_label
from .protocol import BAD_REQUEST, PAUSE_MODES, SELECTORS, SESSION_ALREADY_OPEN
from .sglang import SglangEngine

logger = logging.getLogger(__name__)


class FailurePolicy(str, Enum):
    """What becomes of the engines when an update fails after they were paused: one vocabulary for
    ``UpdateSession(on_failure=)`` and ``WeightSender.update(on_failure=)``. A ``str`` enum: the
    values below are what callers pass and what logs and JSON show."""

    #: nothing was written (by any sender): end the session without a version bump and generate
    #: again, the weights untouched; once anything may have been written, as ``leave_paused``
    RESUME_IF_UNWRITTEN = "resume_if_unwritten"
    #: no end, no bump: stay paused with the session open at the old version, given up by its owner
    #: (torn: the engine refuses to generate until a complete update, which heals it)
    LEAVE_PAUSED = "leave_paused"
    # There is no policy that generates on partly written weights: every p2pweights engine refuses
    # continue_generation inside an open session (engine/core.py), so none could keep it.

    def __str__(self) -> str:  # the value, as a plain str would print (not "FailurePolicy.X")
        return self.value

    @classmethod
    def parse(cls, value: "str | FailurePolicy", allowed: Iterable["FailurePolicy"] | None = None) -> "FailurePolicy":
        """``value`` as a policy, one of ``allowed`` (default: every policy); ValueError otherwise."""
        allowed = tuple(allowed or cls)
        try:
            policy = cls(value)
        except (ValueError, TypeError):
            policy = None
        if policy not in allowed:
            raise ValueError(f"on_failure must be one of {', '.join(p.value for p in allowed)}, got {value!r}")
        return policy


class _InThread:
    """``fn()`` on a daemon thread; :meth:`result` waits for it and returns or re-raises."""

    def __init__(self, fn: Callable[[], Any], name: str):
        self._value: Any = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self._value = fn()
        except BaseException as e:  # noqa: BLE001 - handed to result()
            self._error = e

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


# ---- the update session ----------------------------------------------------------------------

#: per-engine outcomes recorded in UpdateSession.outcome
UPDATED = "updated"                  # ended, version bumped, generating again
ROLLED_BACK = "rolled back"          # opening failed elsewhere before any write: ended without bump, generating
RESUMED_GENERATION = "generating"    # paused but never opened: continued, nothing changed
LEFT_PAUSED = "paused, session open" # writes may have landed: paused, session open, old version
FAILED = "failed"                    # a control call on this engine failed; see errors


class UpdateSessionState(str, Enum):  # an UpdateSession, as its controller sees it: new -> opening -> open -> committed | aborted
    NEW, OPENING, OPEN, COMMITTED, ABORTED = "new", "opening", "open", "committed", "aborted"


class UpdateSession:
    """The control plane of one weight update on many engines, as a context manager::

        with UpdateSession(engines, version=step) as session:
            ...  # every one-sided write; raise if any failed
        # here: every engine ended the update, bumped its version, and generates again

    Opening (``__enter__``): ``pause_generation`` on every engine, then ``begin_weight_update``
    (a receiver whose last begin answered ``protocol.BEGIN_PAUSES`` pauses in its begin: one call),
    as ``owner`` (a secret token; default: a new one, :func:`control.lease.new_owner_id`) asking for a
    lease of ``lease`` seconds (``P2PW_SESSION_LEASE``; each engine grants at most its own), renewed
    every third of the shortest granted while the session is open. Before
    anything is sent, an engine that another session of this process holds is refused
    (``SessionConflict``); a receiver refuses an engine whose session another controller owns
    (HTTP 409, ``SessionConflict`` naming the owner and its session's age). Either way no engine of
    this update is written, and the engines it paused are continued. A receiver whose previous
    session was given up or expired (torn weights) is taken over (``resumed``): this update
    rewrites every byte and heals it. A session an sglang server says is already open is resumed
    only by its own ``owner=`` (sglang cannot say whose it is); otherwise ``SessionConflict``.

    Before ending (just before, or beside the last writes when the sender calls
    :meth:`check_in_soon`), every engine that keeps a lease renews it once more with a short timeout
    (its leader pings every rank): an engine that does not answer, lost its session, or has a
    rank that does not answer is named, not ended, and left paused; the others finish.

    Success (the block returns): ``end_weight_update`` -> ``update_weight_version`` ->
    ``continue_generation`` on every engine, each engine's calls in that order, the engines at once
    (a receiver does all three in its one end call: ``protocol.END_FOLDS``). An engine whose ``end``
    fails is not bumped and is left paused; one whose bump fails is not continued; the others
    (whose weights are the new version) are bumped and continued; then one EngineError names the
    failed ones.

    Failure inside the block (a write failed, a timeout, any exception): no engine is told to end
    the update or bump its version (DESIGN invariant 3). What happens next is ``on_failure``
    (a :class:`FailurePolicy` or its value):

    - ``"leave_paused"`` (default): every engine stays paused with its session open and its old
      version; a receiver is told the owner gave the session up (its weights are torn: it refuses
      to generate until a complete update, which any controller may start at once). Why: after
      ``begin`` an sglang engine's parameters may be partly overwritten and, for
      in-place-quantized models, unpacked (``restore_weights_before_loading``); its weights are
      neither the old nor the new version. Continuing would serve samples from an undefined model
      labelled with the old version (silently poisoned rollouts); ending would run the
      post-processing on torn weights and close the session as if it had succeeded. The engine is
      healed by the next update (which takes the session over and rewrites every byte), or by hand
      (``begin`` to take it over, ``end_weight_update`` + ``continue_generation``) if you accept the
      torn weights.
    - ``"resume_if_unwritten"``: as ``"leave_paused"``, unless the caller says nothing was written
      (``abort(reason, written=False)``): then as :meth:`roll_back` (the block's exit cannot see the
      writes, so it assumes they may have landed).

    Failure while opening (before any write): engines that opened a fresh session are ended
    without a version bump (their weights are untouched; ``end`` re-derives the same buffers) and
    continued; engines only paused are continued; engines with a resumed session stay paused.

    ``outcome`` maps each engine's name to what happened to it; ``errors`` to its control error.
    ``bump_version = False``: no version call (an adapter's update: its end carries its version)."""

    def __init__(self, engines: SglangEngine | Iterable[SglangEngine], version: str | int, *,
                 pause_mode: str = "abort", selector: str = "all", on_failure: str | FailurePolicy = FailurePolicy.LEAVE_PAUSED,
                 torch_empty_cache: bool = True, owner: str | None = None, lease: float | None = None):
        self.engines = [engines] if isinstance(engines, SglangEngine) else list(engines)
        if not self.engines:
            raise ValueError("UpdateSession needs at least one engine")
        check_unique_names(self.engines)
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {', '.join(PAUSE_MODES)}, got {pause_mode!r}")
        if selector not in SELECTORS:
            raise ValueError(f"selector must be one of {', '.join(SELECTORS)}, got {selector!r}")
        self.version = str(version)
        self.pause_mode = pause_mode
        self.selector = selector
        self.on_failure = FailurePolicy.parse(on_failure)
        self.torch_empty_cache = torch_empty_cache
        self.outcome: dict[str, str] = {}
        self.errors: dict[str, BaseException] = {}
        self.resumed: set[str] = set()   # engines whose session a previous update had left open
        self.owner = owner or new_owner_id()  # this controller's secret, on every call (protocol.SESSION_OWNER_HEADER)
        self.owner_given = owner is not None
        self.owner_label = owner_label()  # what engines, logs and errors show of it (protocol.SESSION_LABEL_HEADER)
        self.lease = float(setting("P2PW_SESSION_LEASE", lease))
        self._renewer = LeaseRenewer(self.lease, call_engines)
        self._state = UpdateSessionState.NEW
        self._check_in: _InThread | None = None  # check_in_soon's check-in, overlapping the last writes
        self.folds: set[str] = set()     # engines whose end may bump the version and continue (protocol.END_FOLDS)
        self.pause_in_begin: set[str] = set()  # engines paused by their begin (protocol.BEGIN_PAUSES)
        #: engine -> the registration epoch its begin answered (p2pweights receivers): a sender whose
        #: publications are older re-fetches them before writing (transport/revocation.py)
        self.epochs: dict[str, int] = {}
        self.instances: dict[str, str] = {}  # engine -> the process its begin answered (sender/engine_set.py)
        self.answers: dict[str, Any] = {}  # engine -> its begin answer, then its end answer
        self.dropped: set[str] = set()  # engines left out of the end (drop)
        self.bump_version = True
        self.paused_at: float | None = None  # perf_counter() when pause_generation returned
        #: called (on open's thread) once pause_generation answered on every engine, before begin
        self.on_paused: Callable[[], None] | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> "UpdateSession":
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._state is not UpdateSessionState.OPEN:
            return False
        if exc_type is None:
            self.commit()
        else:
            self.abort(reason=f"{exc_type.__name__}: {exc}")
        return False

    # explicit API (the context manager calls these) -------------------------------------------

    def open(self) -> None:
        """pause_generation then begin_weight_update on every engine; on any failure, roll back
        (see the class doc) and raise one EngineError naming each failed engine."""
        with self._lock:
            if self._state is not UpdateSessionState.NEW:
                raise RuntimeError(f"UpdateSession.open() called twice (state {self._state.value})")
            self._state = UpdateSessionState.OPENING
        try:
            CLAIMS.claim(self.engines, self.owner)  # before anything is sent
        except SessionConflict as e:
            self._state = UpdateSessionState.ABORTED
            self.errors[e.engine] = e
            self.outcome = {n.name: RESUMED_GENERATION if n.name != e.engine else FAILED for n in self.engines}
            raise UpdateRefused(dict(self.errors), what="opening the weight update") from None
        for e in self.engines:
            e.session_owner, e.session_label = self.owner, self.owner_label
        # engines whose last begin said it may pause first: paused by their begin, in one round trip
        # (not when the caller waits for the pause alone: on_paused)
        self.pause_in_begin = set() if self.on_paused is not None else {
            e.name for e in self.engines if PAUSE_IN_BEGIN.folds(e)}
        paused = call_engines([e for e in self.engines if e.name not in self.pause_in_begin], "pause_generation",
                              self.pause_mode)
        self.paused_at = time.perf_counter()  # the update's measured time starts here
        if self.on_paused is not None:
            self.on_paused()
        self.errors.update(paused.errors)
        begun: EngineCalls | None = None
        if paused.ok:
            begun = call_engines(self.engines, self._begin)
            self.answers.update(begun.results)
            self.errors.update(begun.errors)
        if not self.errors:
            self._state = UpdateSessionState.OPEN
            self._renewer.start()
            return
        # roll back: nothing has been written yet; an engine another controller owns is not touched
        by_name = {e.name: e for e in self.engines}
        owned_elsewhere = {n for n, err in self.errors.items() if isinstance(err, SessionConflict)}
        opened_fresh = [by_name[n] for n in (begun.results if begun else {}) if n not in self.resumed]
        only_paused = [by_name[n] for n in [*paused.results, *(self.pause_in_begin if begun else ())]
                       if not (begun and n in begun.results) and n not in owned_elsewhere]
        ended = call_engines(opened_fresh, "end_weight_update")
        continued = call_engines(list(only_paused) + [by_name[n] for n in ended.results],
                                 "continue_generation", self.torch_empty_cache)
        for n, err in list(ended.errors.items()) + list(continued.errors.items()):
            self.errors.setdefault(n, err)
        for e in self.engines:
            n = e.name
            if n in self.errors:
                self.outcome[n] = FAILED
            elif n in self.resumed:
                self.outcome[n] = LEFT_PAUSED
            elif n in ended.results:
                self.outcome[n] = ROLLED_BACK
            else:
                self.outcome[n] = RESUMED_GENERATION
        self._state = UpdateSessionState.ABORTED
        self._renewer.release([by_name[n] for n in self.resumed])  # taken over torn: torn again
        self._done()
        if owned_elsewhere:  # an EnginesFailed that is also a SessionConflict
            raise UpdateRefused(dict(self.errors), what="opening the weight update")
        raise engines_failed("opening the weight update", self.errors)

    def lease_deadline(self, engine: str | None = None) -> float:
        """Until when (``time.monotonic()``) this owner may still post writes to ``engine`` (default: the
        earliest of its engines): its last begin or renewal + the granted lease - a margin; ``-inf`` once
        it refused a renewal or the session was given up or is over; ``inf`` where no lease is kept
        (:meth:`control.lease.LeaseRenewer.deadline`; ``self.renewer.on_deadline`` hears each change)."""
        return self._renewer.deadline(engine)

    @property
    def renewer(self) -> LeaseRenewer:
        """The lease renewal of this session (granted leases, last renewals, deadlines)."""
        return self._renewer

    def check_in_soon(self) -> None:
        """Start the last lease check-in now, on a thread, so that it overlaps the last writes (the
        sender calls this when its last slot is placed); :meth:`commit` takes its answer instead of
        checking in again. A leader that stops answering after it is not found by the check-in but
        by ``end_weight_update`` itself (named and left paused, at the engine's timeout), as is a
        rank (the leader pings its ranks before it ends). No-op when no engine keeps a lease."""
        self._require_open("check_in_soon")
        if self._check_in is None and self._renewer.leased:
            self._check_in = _InThread(lambda: self._renewer.check_in(self.engines), "p2pw-check-in")

    def commit(self) -> None:
        """Every write succeeded: end -> bump version -> continue on every engine, each engine's
        three calls one after the other (its version bumped only once it ended, continued only once
        its version says what its weights are) and the engines at once."""
        self._require_open("commit")
        # a stalled engine or rank is named now, in seconds (check_in_soon: already asked)
        stalled = self._check_in.result() if self._check_in is not None else self._renewer.check_in(self.engines)
        stalled = {n: e for n, e in stalled.items() if n not in self.dropped}
        self.errors.update(stalled)

        steps: dict[str, float] = {}  # verb -> the slowest engine's seconds (the verbs' log, as call_engines')

        def step(verb: str, call: Callable[[], Any]) -> None:
            t0 = time.perf_counter()
            try:
                call()
            except Exception as err:
                raise StepFailed(verb, err) from err
            finally:
                with self._lock:
                    steps[verb] = max(steps.get(verb, 0.0), time.perf_counter() - t0)

        def end_version_continue(e: SglangEngine) -> None:
            if e.name in self.folds:  # one call: the receiver bumps and continues once it ended
                answer: list = []
                step("end_weight_update", lambda: answer.append(e.end_weight_update(
                    then_version=self.version, torch_empty_cache=self.torch_empty_cache)))
                self._renewer.forget(e)
                self.answers[e.name] = answer[0]
                if end_folded(e, answer[0]):
                    timings = answer[0].get(p.TIMINGS_KEY)  # the receiver's own seconds for each
                    with self._lock:
                        for verb in ("update_weight_version", "continue_generation"):
                            said = timings.get(f"{verb}_s") if isinstance(timings, dict) else None
                            seconds = float(said) if isinstance(said, (int, float)) else 0.0
                            steps[verb] = max(steps.get(verb, 0.0), seconds)
                    return
            else:  # its answer kept: the sglang plugin's end answers its new base (deltas/committed.py)
                step("end_weight_update", lambda: self.answers.update({e.name: e.end_weight_update()}))
                self._renewer.forget(e)  # ended: nothing left to renew
            if self.bump_version:  # not for an adapter's update: its version goes with its end (engine/adapters.py)
                step("update_weight_version", lambda: e.update_weight_version(self.version))
            step("continue_generation", lambda: e.continue_generation(self.torch_empty_cache))

        finished = call_engines([e for e in self.engines if e.name not in stalled], end_version_continue)
        self._renewer.stop()
        log = verb_log.get()
        if log is not None:  # per verb, as if each had run on every engine at once
            log[:] = [x for x in log if x[0] != "end_version_continue"]
            log += [(verb, seconds, len(self.engines)) for verb, seconds in steps.items()]
        not_ended = set(stalled)
        for name, err in finished.errors.items():
            failed, cause = (err.step, err.error) if isinstance(err, StepFailed) else ("end_weight_update", err)
            self.errors[name] = cause
            if failed == "end_weight_update":
                not_ended.add(name)
        for e in self.engines:
            self.outcome[e.name] = (UPDATED if e.name not in self.errors else LEFT_PAUSED if e.name in not_ended
                                    else FAILED)
        self._state = UpdateSessionState.COMMITTED
        self._renewer.release([e for e in self.engines if e.name in not_ended])  # torn until healed
        self._done()
        failed = {n: e for n, e in self.errors.items() if n not in self.dropped}  # dropped: the caller reports them
        if failed:
            raise engines_failed(f"finishing weight update {self.version}", failed)

    def drop(self, names: Iterable[str], reason: str) -> None:
        """Leave ``names`` out of the end (their writes failed; the caller commits the others): given up
        there (torn until a complete update, as after :meth:`abort`), named in ``outcome``/``errors``."""
        self._require_open("drop")
        gone = [e for e in self.engines if e.name in set(names)]
        self.engines = [e for e in self.engines if e not in gone]
        self._renewer.release(gone)  # never raises; a dead engine's error is returned and ignored
        for e in gone:
            self._renewer.forget(e)
            self.dropped.add(e.name)
            self.outcome[e.name] = LEFT_PAUSED
            self.errors[e.name] = EngineError(f"engine {e.name}: left out of the end of update {self.version}: {reason}",
                                              engine=e.name)
        logger.warning("weight update %s: %s left out of the end (%s)", self.version, [e.name for e in gone], reason)

    def abort(self, reason: str = "", *, written: bool = True) -> None:
        """The update failed: no end, no version bump; then ``on_failure`` (see the class doc).
        ``written``: whether any write of this update may have landed (only ``resume_if_unwritten``
        asks). Never raises for the engines' sake (the caller is already handling the real error)."""
        if not written and self.on_failure is FailurePolicy.RESUME_IF_UNWRITTEN:
            self.roll_back(reason)
            return
        self._require_open("abort")
        self._state = UpdateSessionState.ABORTED
        self._settle_check_in()
        if reason:
            logger.warning("weight update %s failed (%s): engines stay paused with their session open", self.version,
                           reason)
        for e in self.engines:
            self.outcome[e.name] = LEFT_PAUSED
        self._renewer.stop()
        self._renewer.release(self.engines)  # torn until a complete update, which anyone may start now
        self._done()

    def roll_back(self, reason: str = "") -> None:
        """The update failed before any write: end the session without a version bump and
        continue generation (the weights are untouched; ``end`` re-derives the same buffers), as a
        failed ``open`` does. Engines whose session a previous update had left open (``resumed``:
        torn weights) stay paused. Never raises for the engines' sake."""
        self._require_open("roll_back")
        self._state = UpdateSessionState.ABORTED
        self._settle_check_in()
        fresh = [e for e in self.engines if e.name not in self.resumed]
        if reason:
            logger.warning("weight update %s failed before any write (%s): engines end the session without a "
                           "version bump and continue", self.version, reason)
        ended = call_engines(fresh, "end_weight_update")
        by_name = {e.name: e for e in self.engines}
        continued = call_engines([by_name[n] for n in ended.results], "continue_generation", self.torch_empty_cache)
        for n, err in list(ended.errors.items()) + list(continued.errors.items()):
            self.errors.setdefault(n, err)
        for e in self.engines:
            self.outcome[e.name] = (FAILED if e.name in self.errors else LEFT_PAUSED if e.name in self.resumed
                                    else ROLLED_BACK)
        self._renewer.stop()
        self._renewer.release([e for e in self.engines if e.name in self.resumed or e.name in self.errors])
        self._done()

    def _begin(self, engine: SglangEngine) -> dict:
        pause_first = engine.name in self.pause_in_begin
        extra = engine.begin_extra
        if pause_first:
            engine.begin_extra = {**extra, p.PAUSE_FIRST: {"mode": self.pause_mode}}
        try:
            sent_at = time.monotonic()  # the engine's lease starts no earlier (lease_deadline)
            answer = engine.begin_weight_update(self.selector, lease=self.lease)
            if pause_first and not PAUSE_IN_BEGIN.paused(answer):  # another server now: pause it apart, before any write
                engine.pause_generation(self.pause_mode)
            PAUSE_IN_BEGIN.learn(engine, answer)
        except EngineError as e:
            PAUSE_IN_BEGIN.forget(engine)  # the next update pauses it apart
            if not (SESSION_ALREADY_OPEN in str(e) and f"HTTP {BAD_REQUEST}" in str(e)):
                raise
            # never a silent resume of a session that may be someone else's (the sglang plugin's gate
            # admits only the owner: "already open" is then this owner's own)
            if not self.owner_given and p.PLUGIN_SESSIONS not in engine.plugin_offers:
                raise SessionConflict(
                    f"engine {engine.name} ({engine.base_url}): a weight-update session is already open and this "
                    f"update did not open it (an sglang server cannot say whose it is); refused before writing",
                    engine=engine.name, hint="if a failed update of yours left it open, end it by hand "
                    "(end_weight_update, continue_generation: its weights may be torn), or open the update "
                    "with the owner= that opened it") from e
            logger.warning("engine %s: owner %s resumes its own weight-update session", engine.name, self.owner_label)
            with self._lock:
                self.resumed.add(engine.name)
            try:  # a receiver or the sglang plugin keeps a lease on it (plain sglang has no renew route)
                sent_at = time.monotonic()
                self._renewer.keep(engine, engine.renew_weight_update(lease=self.lease)["lease"], sent_at)
            except (EngineError, KeyError, TypeError, ValueError):
                pass
            return {"success": True, "message": "resumed this owner's open weight-update session"}
        finally:
            engine.begin_extra = extra
        if isinstance(answer, dict) and answer.get("lease") is not None:
            self._renewer.keep(engine, answer["lease"], sent_at)  # the lease the engine granted
        if isinstance(answer, dict) and answer.get(p.END_FOLDS) is True:
            with self._lock:
                self.folds.add(engine.name)
        epoch = answer.get("epoch") if isinstance(answer, dict) else None
        if isinstance(epoch, int) and not isinstance(epoch, bool) and epoch > 0:
            with self._lock:
                self.epochs[engine.name] = epoch
        instance = answer.get("instance") if isinstance(answer, dict) else None
        if isinstance(instance, str) and instance:
            self.instances[engine.name] = instance  # one key per engine thread: no lock needed
        if isinstance(answer, dict) and answer.get("took_over"):
            logger.warning("engine %s: took over a torn weight-update session; this update heals it", engine.name)
            with self._lock:
                self.resumed.add(engine.name)
        return answer

    def _settle_check_in(self) -> None:
        """An early check-in still in flight lands before the session is given up or rolled back
        (a renewal after a release would be refused, after a roll-back meet no session)."""
        if self._check_in is not None:
            try:
                self._check_in.result()
            except Exception:  # noqa: BLE001 - the session fails anyway; its verdict is not needed
                pass

    def _done(self) -> None:
        """The session is over for this controller: no more owner token on its calls, no claim."""
        self._renewer.stop()
        for e in self.engines:
            if e.session_owner == self.owner:
                e.session_owner = e.session_label = None
        CLAIMS.release(self.engines, self.owner)

    def _require_open(self, what: str) -> None:
        if self._state is not UpdateSessionState.OPEN:
            raise RuntimeError(f"UpdateSession.{what}() needs an open session (state {self._state.value})")
