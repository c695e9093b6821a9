"""The engine core: every decision an engine that takes one-sided writes makes, written once.

Our receiver, the sglang plugin and the vLLM backend are hosts of this core: each maps its engine's
routes onto the verbs below and each :mod:`.steps` request onto its engine's own calls, and decides
nothing (docs/architecture.md, "One engine core, three hosts"). The core owns the session
(:class:`~.session.SessionKeeper`: owner, lease, torn), the epoch, the committed base of deltas
(``deltas/committed.py``) and the sequence of every verb. docs/protocol.md, "The engine's rules",
says the same to a user.

The rules, in the order a verb meets them:

1. **Owner rules** (``session.py``): another controller's call of a live session answers 409
   (``SessionConflict``); a torn engine accepts only pause, begin (a takeover) and a broadcast
   group's join or leave (409 ``TornWeights``). A begin needs an unguessable owner token (400).
2. **Takeover: revoke, then open.** A begin that takes a lost owner's session over (expired,
   given up, torn) first has every rank revoke what the old epoch could reach, at an epoch after the
   session's and after any a rank already publishes; only once every rank answered does the epoch
   move and the begin go on. A revocation that fails fails the begin (500) and the engine stays torn.
3. **Begin needs a paused engine** (400): one-sided writes land in live parameter memory. A begin
   by the owner of the open session is refused (400: end it first). From the begin on the weights
   may change, so the committed base is forgotten whatever follows; the begin answers whether the
   sender's delta claim holds (``p2pw_delta``), the lease granted and the epoch.
4. **The tear rule.** Once a session is open, any failure of a verb that changes the weights —
   the end (a rank's delta apply refused or raised, the engine's post-processing failed), an apply
   of deltas inside the session, a write through the engine's own route — tears the engine: the
   base is forgotten, no owner holds the session any more, and the engine stays paused and answers
   ``torn`` until a complete update (a takeover's begin, every write, an end) heals it. So are an
   expired lease and an owner's release (``session.py``). Nobody is told success when the weights
   could be partly written. A call refused before it runs (a malformed body, manifests the begin
   did not accept) changes nothing: the owner may send it again.
5. **The end** parses the owner's manifests once (``{"<rank>": manifest}``, or a list of disjoint
   segments where several writers (PP stages) wrote one rank's area, or one writer applied part of
   its records beside its writes), has every rank apply its own and then the engine post-process
   (one :class:`~.steps.End` step), and only then commits: a new base token at the current epoch,
   the session closed. Inside the session the owner may apply segments before the end
   (``p2pw_apply_deltas``, as its slots' writes return): every byte of a rank's area is applied at
   most once per session (a segment overlapping one applied before is 400, nothing runs), and the
   session's deltas end with its end. The version is set only after the end (400 while a session is open); generation
   continues only outside a session (400 while one is open).
6. **Memory released and resumed** (colocated RL frees the weights' memory while it trains): once
   released, a begin is refused (400) until the memory is resumed, and a release inside an open
   session tears it; a resume re-registers and re-publishes every rank under a new epoch (the
   takeover's revocation) before anyone may write, so a sender that wrote before finds its old
   connections closed and follows the new epoch at its next begin.
7. **Writes through the engine's own routes** forget the base (the next delta is refused and the
   sender writes in full); a broadcast write and a reset of the weights run only inside the
   caller's own session, while sglang's ``update_weights_from_disk`` / ``_tensor`` / ``_ipc`` (whole
   updates of the engine's own) run outside one too. **Whatever else rewrites or frees the weights'
   memory** (memory release/resume, a worker RPC) forgets the base as well.
"""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import secrets
import threading
import time
from typing import Any, Callable, Iterable

from ..control import bodies
from ..control import protocol as p
from ..control.error_answers import error_payload
from ..deltas.area import parse_segments, segments_wire
from ..deltas.committed import BASE_KEY, DELTA_KEY, CommittedBase
from ..errors import EngineError, InvalidRequest, InvalidWrite, OutOfOrder, P2PWeightsError
from . import session as sk
from .adapters import ADAPTER_KEY, ADAPTER_VERSION_KEY, LOAD_ADAPTER, UNLOAD_ADAPTER, AdapterTargets, adapter_name
from .steps import (
    AdapterSlot,
    Answer,
    ApplyDeltas,
    DeltaSupport,
    End,
    EngineVerb,
    IsPaused,
    PublishedEpochs,
    Revoke,
    Verb,
    drive,
    drive_async,
)

logger = logging.getLogger(__name__)

PAUSE, CONTINUE, VERSION = "pause_generation", "continue_generation", "update_weight_version"
BEGIN, END, RENEW, APPLY = "begin_weight_update", "end_weight_update", "renew_weight_update", "p2pw_apply_deltas"
JOIN, LEAVE = "init_weights_update_group", "destroy_weights_update_group"
RELEASE, RESUME = "release_memory_occupation", "resume_memory_occupation"
#: the engine's own writes into the weights: a failure inside an open session tears it
ENGINE_WRITES = frozenset({"update_weights_from_distributed", "update_weights_from_tensor", "update_weights_from_disk",
                           "update_weights_from_ipc", "reset_weights"})
#: of which those that run only inside the caller's open session (the others are whole updates of
#: the engine's own, as sglang's update_weights_from_disk)
IN_SESSION = frozenset({"update_weights_from_distributed", "reset_weights"})
#: what else rewrites or frees the weights' memory: owner rules, then the base is forgotten
FORGETS = frozenset({RELEASE, RESUME, "collective_rpc"})
#: the engine's own writes of a LoRA adapter's slot (adapters.py): outside any session
ADAPTER_WRITES = frozenset({LOAD_ADAPTER, UNLOAD_ADAPTER})
#: every verb the core decides; reads (server info, publications, digests, checks) are anyone's
VERBS = frozenset({PAUSE, CONTINUE, VERSION, BEGIN, END, RENEW, APPLY, JOIN, LEAVE}) | ENGINE_WRITES | FORGETS \
    | ADAPTER_WRITES
#: verbs that run beside the others: joining a group waits for every member; a renewal must get
#: through while the owner's own end holds the engine
UNSERIALIZED = frozenset({JOIN, LEAVE, RENEW})


class EngineCore:
    """One engine's decisions (module docstring). ``engine``: the name errors give it; ``lease``: the
    longest lease it grants (``P2PW_SESSION_LEASE``). ``begin_pauses`` / ``end_folds``: the owner may fold
    its pause into its begin (``protocol.PAUSE_FIRST``) and its version and continue into its end
    (``protocol.END_THEN``); the begin says which the engine offers."""

    def __init__(self, engine: str = "engine", lease: float | None = None,
                 clock: Callable[[], float] = time.monotonic, *, begin_pauses: bool = False, end_folds: bool = False):
        self.begin_pauses, self.end_folds = bool(begin_pauses), bool(end_folds)
        self.released: str | None = None  # why the weights' memory is released (a begin waits for the resume)
        self.session = sk.SessionKeeper(engine, lease, clock)
        self.base = CommittedBase(engine)
        # LoRA adapters (adapters.py): each adapter's slot is a target with its own base and version
        self.adapters = AdapterTargets(engine)
        self.target: str | None = None  # the adapter of the open (or last) session; None: the base weights
        # each rank's area bytes applied in the open session, [(start, end)] ascending: none twice (rule 5)
        self._applied: dict[int, list[tuple[int, int]]] = {}
        # this engine process's identity: a sender that finds another one at the same address (a
        # restart: new registrations, no base) re-plans it before writing (sender/engine_set.py)
        self.instance = secrets.token_hex(8)
        self._thread_lock = threading.RLock()
        self._async_lock: asyncio.Lock | None = None

    @property
    def engine(self) -> str:
        return self.session.engine

    @engine.setter
    def engine(self, name: str) -> None:
        self.session.engine = self.base.engine = self.adapters.engine = name

    # ---- running a verb ---------------------------------------------------------------------------
    def run(self, verb: str, headers: Any, body: Any, do: Callable[[Any], Any]) -> Answer:
        """``verb`` with ``headers`` (the owner's) and ``body`` (a dict, or None), each step by ``do``;
        verbs run one at a time but for :data:`UNSERIALIZED`. Raises the typed errors the front
        answers (``front`` / ``control.error_answers``)."""
        with self._thread_lock if verb not in UNSERIALIZED else contextlib.nullcontext():
            return drive(self.verb(verb, headers, body), do)

    async def run_async(self, verb: str, headers: Any, body: Any, do: Callable[[Any], Any]) -> Answer:
        """:meth:`run` for an asyncio host (``do`` returns a coroutine)."""
        if self._async_lock is None:
            self._async_lock = asyncio.Lock()
        async with self._async_lock if verb not in UNSERIALIZED else contextlib.nullcontext():
            return await drive_async(self.verb(verb, headers, body), do)

    def verb(self, verb: str, headers: Any, body: Any) -> Verb:
        """The generator of one call of ``verb`` (:mod:`.steps`)."""
        if verb not in VERBS:
            raise ValueError(f"the engine core has no verb {verb!r}")
        owner, lease = sk.owner_of(headers), sk.lease_of(headers)
        body = dict(body) if isinstance(body, dict) else ({} if body is None else body)
        if verb == BEGIN:
            return self._begin(owner, lease, sk.label_of(headers, owner), body)
        if verb == END:
            return self._end(owner, body)
        if verb == APPLY:
            return self._apply(owner, body)
        if verb == RENEW:
            return self._renew(owner, lease, body)
        return self._engine_verb(verb, owner, body)

    # ---- the verbs --------------------------------------------------------------------------------
    def _begin(self, owner: str, lease: float | None, label: str, body: Any) -> Verb:
        self.session.check(BEGIN, owner)
        sk.check_owner_token(owner)
        if self.session.open and self.session.held:
            raise OutOfOrder(f"engine {self.engine}: a weight-update session is {p.SESSION_ALREADY_OPEN}; call "
                                 f"end_weight_update() first")
        if self.released:
            raise OutOfOrder(f"engine {self.engine}: {self.released}; call resume_memory_occupation() before "
                             f"begin_weight_update()")
        pause = bodies.begin_pause(body.pop(p.PAUSE_FIRST, None)) if isinstance(body, dict) else None
        adapter = body.pop(ADAPTER_KEY, None) if isinstance(body, dict) else None
        adapter = adapter_name(adapter, BEGIN) if adapter is not None else None
        takeover = self.session.lost
        if takeover:  # the lost owner's writes in flight must land nothing, before anything else happens
            if self.target is not None:  # a lost adapter session: its slot may be half written
                self.adapters.lost(self.target, self.session.torn or "its update session was lost")
            yield from self._revoke()
        paused = None
        if pause is not None:  # the owner's pause, folded in
            paused = yield from self._sub_verb(PAUSE, bodies.encode(pause))
            if not paused.ok:
                return paused
        if not (yield IsPaused()):
            raise OutOfOrder(f"engine {self.engine}: generation is running; call pause_generation() before "
                                 f"begin_weight_update() (p2pweights writes land in live parameter memory)")
        slot = None
        if adapter is not None:  # the engine's registry decides the slot; not loaded: refused, nothing changed
            try:
                slot = int((yield AdapterSlot(adapter)))
            except Exception as e:  # noqa: BLE001 - the host's refusal, in one line naming the fix
                raise InvalidRequest(f"engine {self.engine}: LoRA adapter {adapter!r} has no slot to write: {e}",
                                     engine=self.engine, parameter=adapter,
                                     hint=f"load it once with the engine's load_lora_adapter (lora_name={adapter!r}, "
                                          f"pinned=True), then update it") from e
            body[ADAPTER_KEY] = adapter  # the host skips the base weights' hooks
        claim = body.pop(DELTA_KEY, None) if isinstance(body, dict) else None
        # an adapter's slot is written directly (no delta area): every rank supports its deltas
        support = (yield DeltaSupport()) if claim is not None and adapter is None else ""
        base = self.adapters.base(adapter) if adapter is not None else self.base
        delta = base.open(claim, self.session.epoch, support)  # from here the target's bytes may change
        self._applied = {}
        self.target = adapter
        try:
            answer = yield EngineVerb(BEGIN, body)
        except Exception as e:  # noqa: BLE001 - the engine's begin raised: an answer like any failed one
            answer = _failed(BEGIN, e)
        if takeover and answer.already_open:  # the engine's session is still the lost owner's: continued
            answer = Answer(p.OK, {"success": True, "message": f"took over a {p.TORN} weight-update session: a "
                                                               f"complete update heals it"})
        if not answer.ok:
            return answer
        took_over = self.session.begin(owner, lease, label)
        folds = {**({p.BEGIN_PAUSES: True} if self.begin_pauses else {}), **({p.END_FOLDS: True} if self.end_folds else {}),
                 **({p.PAUSE_FIRST: paused.body} if paused is not None else {})}
        return answer.with_body({**(answer.body if isinstance(answer.body, dict) else {}), "lease": self.session.lease,
                                  "lease_max": self.session.max_lease, "took_over": took_over,
                                  "epoch": self.session.epoch, "instance": self.instance, DELTA_KEY: delta, **folds,
                                  **({ADAPTER_KEY: {"name": adapter, "slot": slot}} if adapter is not None else {})})

    def _revoke(self, what: str = "the takeover") -> Verb:
        published = [int(e) for e in ((yield PublishedEpochs()) or ()) if isinstance(e, int)]
        epoch = self.next_epoch(published)
        try:
            reached = yield Revoke(epoch)
        except Exception as e:  # noqa: BLE001 - any rank that could not: the begin fails, still torn
            raise EngineError(f"engine {self.engine}: {what} could not revoke the registrations of epoch "
                              f"{self.session.epoch} (to epoch {epoch}): {type(e).__name__}: {e}; nobody may write "
                              f"until it is retried", engine=self.engine,
                              hint="retry the call; the engine's log names the rank") from e
        if reached is None:
            logger.warning("engine %s: %s, but it holds no revocable registrations: the epoch stays %d; writes "
                           "posted before may still land", self.engine, what, self.session.epoch)
            return
        self.session.epoch = int(reached)
        logger.warning("engine %s: %s revoked the registrations of the last epoch: now epoch %d", self.engine, what,
                       self.session.epoch)

    def next_epoch(self, published: Iterable[int] = ()) -> int:
        """The epoch a revocation moves to: after the session's and after any a rank already reached
        (a revocation that failed half-way)."""
        return max([self.session.epoch, *published]) + 1

    def _end(self, owner: str, body: Any) -> Verb:
        self.session.check(END, owner)
        if not self.session.open:
            raise OutOfOrder(f"engine {self.engine}: {p.NO_SESSION} is open; call begin_weight_update() first")
        # checked before anything runs: a malformed body is refused and changes nothing (the owner may retry)
        then = bodies.end_then(body.pop(p.END_THEN, None)) if isinstance(body, dict) and self.end_folds else None
        adapter, adapter_version = self.target, body.pop(ADAPTER_VERSION_KEY, None) if isinstance(body, dict) else None
        if adapter is not None:
            if adapter_version is None and then is not None:
                adapter_version = then["new_version"]
            if not isinstance(adapter_version, (str, int)) or isinstance(adapter_version, bool):
                raise InvalidRequest(f"{END}: the update of LoRA adapter {adapter!r} needs {ADAPTER_VERSION_KEY!r} "
                                     f"(its new version) in the end's body")
            body[ADAPTER_KEY] = adapter  # the host skips the base weights' post-processing
        manifests = self._manifests(body.pop(DELTA_KEY, None) if isinstance(body, dict) else None, END)
        try:
            answer = yield End(manifests, body)
        except Exception as e:  # noqa: BLE001 - a rank refused its deltas, or the engine's end raised
            answer = _failed(END, e)
        if not answer.ok:
            self.tear(f"{END} failed (HTTP {answer.status}): {_why(answer)}; the weights may be partly written")
            return answer
        base = self._base().commit(self.session.epoch)  # what the engine holds now: a new identity
        if adapter is not None:
            self.adapters.committed(adapter, str(adapter_version))
        self.session.end()
        out = {**(answer.body if isinstance(answer.body, dict) else {}), BASE_KEY: base}
        if then is not None:  # as the owner's own next calls would: the version, then (once bumped) continue
            # an adapter's version is its own (set above), not the engine's weight version
            steps = [(VERSION, {"new_version": then["new_version"], "abort_all_requests": False})] if adapter is None \
                else []
            if then["continue"]:
                steps.append((CONTINUE, {"torch_empty_cache": then["torch_empty_cache"]}))
            # an adapter's version was set by the commit above: the fold says so under the version's verb
            done = {} if adapter is None else {VERSION: {"success": True, "message": f"LoRA adapter {adapter!r} is "
                                                                                    f"version {adapter_version}"}}
            for verb, step_body in steps:
                done[verb] = (sub := (yield from self._sub_verb(verb, step_body))).body
                if not sub.ok:
                    break
            out[p.END_THEN] = done
        return answer.with_body(out)

    def _sub_verb(self, verb: str, body: Any) -> Verb:
        """The engine's ``verb`` inside another (a fold): its answer, a raise answered as a failure."""
        try:
            return (yield EngineVerb(verb, body))
        except Exception as e:  # noqa: BLE001 - the outer verb answers what failed
            return _failed(verb, e)

    def _apply(self, owner: str, body: Any) -> Verb:
        self.session.check(APPLY, owner)
        if not self.session.open:
            raise OutOfOrder(f"engine {self.engine}: {p.NO_SESSION} is open; deltas are applied inside a session")
        manifests = self._manifests((body or {}).get("manifests") if isinstance(body, dict) else None, APPLY)
        if manifests is None:
            raise InvalidRequest(f"{APPLY}: the body must name 'manifests' ({{rank: manifest}})")
        try:
            yield ApplyDeltas(manifests)
        except Exception as e:  # noqa: BLE001 - any rank's refusal: nothing is known to be whole
            self.tear(f"the deltas were refused, the weights may be partly applied: {type(e).__name__}: {e}")
            raise InvalidWrite(f"engine {self.engine}: {APPLY} refused: the deltas were not applied: {e}",
                               engine=self.engine) from e
        return Answer(p.OK, {"success": True, "message": "Success"})

    def _renew(self, owner: str, lease: float | None, body: Any) -> Verb:
        self.session.check(RENEW, owner)
        if not self.session.open:
            raise OutOfOrder(f"engine {self.engine}: {p.NO_SESSION} is open on this engine: nothing to renew")
        release = body.get("release", False) if isinstance(body, dict) else False
        if not isinstance(release, bool):
            raise InvalidRequest("field 'release' must be a boolean")
        if release:
            self.session.release(owner)
            self._base().forget("the owner gave its session up")
            if self.target is not None:
                self.adapters.lost(self.target, "the owner gave its session up")
            return Answer(p.OK, {"success": True, "message": f"session released: the weights are {p.TORN} until a "
                                                             f"complete update"})
        granted = self.session.renew(lease)
        answer = yield EngineVerb(RENEW, body)  # the host may check its ranks answer (a stalled one is named)
        if not answer.ok:
            return answer
        return Answer(p.OK, {"success": True, "message": "lease renewed", "lease": granted})

    def _engine_verb(self, verb: str, owner: str, body: Any) -> Verb:
        if verb == CONTINUE:  # a torn adapter is named first: it is what a complete update must heal
            self.adapters.check_continue(verb)
        self.session.check(verb, owner)
        session_open = self.session.open
        if verb in IN_SESSION and not session_open:
            raise OutOfOrder(f"engine {self.engine}: {verb} must run between begin_weight_update() and "
                                 f"end_weight_update() (inside the caller's own session)")
        if verb == VERSION and session_open:
            raise OutOfOrder(f"engine {self.engine}: a weight-update session is open; call end_weight_update() "
                                 f"before update_weight_version() (the version is bumped only after the update ended)")
        if verb == CONTINUE and session_open:
            raise OutOfOrder(f"engine {self.engine}: a weight-update session is open; call end_weight_update() "
                                 f"before continue_generation() (the weights may be partly written)")
        adapter = None
        if verb in ADAPTER_WRITES:  # the engine's own load or unload of an adapter's slot
            adapter = adapter_name(body.get("lora_name") if isinstance(body, dict) else None, verb)
            if session_open:
                raise OutOfOrder(f"engine {self.engine}: {verb} of LoRA adapter {adapter!r} while a weight-update "
                                 f"session is open; end it first")
        try:
            answer = yield EngineVerb(verb, body)
        except Exception as e:  # noqa: BLE001 - the engine's route raised: settled like a failed answer
            answer = _failed(verb, e)
        if verb in ENGINE_WRITES or verb in FORGETS:
            self.base.forget(f"{verb} ran after the last commit")
        if adapter is not None and answer.ok:
            (self.adapters.loaded if verb == LOAD_ADAPTER else self.adapters.unloaded)(adapter)
        elif adapter is not None:  # a failed load may have written part of the slot
            self.adapters.base(adapter).forget(f"{verb} failed after the last commit")
        if verb in ENGINE_WRITES and session_open and not answer.ok:
            self.tear(f"{verb} failed (HTTP {answer.status}): {_why(answer)}; the weights may be partly written")
        if verb == RELEASE and answer.ok:
            self.released = "the weights' memory is released (release_memory_occupation)"
            if self.session.open:
                self.tear("the weights' memory was released inside the session")
        if verb == RESUME and answer.ok:  # the memory is back: every rank re-published under a new epoch first
            yield from self._revoke("the resume")
            self.released = None
        return answer

    # ---- the rules a verb shares ----------------------------------------------------------------
    def tear(self, why: str) -> None:
        """The tear rule (module docstring, 4): the base forgotten, no owner, torn until a complete update
        (of an adapter: torn until a complete update of that adapter, adapters.py)."""
        self._base().forget(why)
        if self.target is not None:
            self.adapters.lost(self.target, why)
        self.session.tear(why)

    def _base(self) -> CommittedBase:
        """The committed base of the open (or last) session's target."""
        return self.adapters.base(self.target) if self.target is not None else self.base

    def _manifests(self, manifests: Any, verb: str) -> dict[int, dict] | None:
        """The owner's ``{"<rank>": manifest}`` checked whole (None: it names none): no segment may
        overlap area bytes applied before in this session (rule 5). Once checked, the bytes count as
        applied (a refused apply tears the session anyway); the end takes the session's deltas."""
        if manifests is None:
            if verb == END:
                self._base().accepted = False
            return None
        if not self._base().accepted:
            raise InvalidRequest(f"{verb} names deltas, but this session's begin did not accept any (or the session "
                                 f"ended)")
        if not isinstance(manifests, dict):
            raise InvalidRequest(f"{verb}: {DELTA_KEY} must be {{rank: manifest}}")
        parsed, spans = {}, {}
        for rank, m in manifests.items():
            if not (isinstance(rank, str) and rank.isdigit()):
                raise InvalidRequest(f"{verb}: {DELTA_KEY} has a key {rank!r} that is not a rank")
            where = f"{verb} {DELTA_KEY}[{rank}]"
            try:
                segments = parse_segments(m, where)
            except InvalidWrite as e:
                raise InvalidRequest(str(e)) from None
            spans[int(rank)] = applied_after(self._applied.get(int(rank), []), segments, where)
            parsed[int(rank)] = segments_wire(segments)
        self._applied.update(spans)
        if verb == END:
            self._base().accepted = False
        return parsed

    def state(self) -> dict:
        """The session's state as ``/server_info``'s ``p2pw_weight_update`` says it (JSON-ready)."""
        state = self.session.state()
        adapters = self.adapters.state()  # LoRA adapters updated or torn (only when there are some)
        return {**state, "state": str(state["state"]), "instance": self.instance, **({"adapters": adapters} if adapters else {})}


def applied_after(applied: list[tuple[int, int]], segments: Iterable[Any], where: str) -> list[tuple[int, int]]:
    """``applied`` (a rank's [start, end) spans applied in the session, ascending) with ``segments``
    added; InvalidRequest naming the segment when one overlaps a span applied before."""
    out = list(applied)
    for k, m in enumerate(segments):
        if not m.bytes:
            continue
        lo, hi = m.start, m.start + m.bytes
        at = bisect.bisect_right(out, (lo, hi))
        if (at and out[at - 1][1] > lo) or (at < len(out) and out[at][0] < hi):
            raise InvalidRequest(f"{where}: segment {k} names area bytes [{lo}, {hi}), part of which this session "
                                 f"applied already (each byte of an area is applied at most once per session)")
        out.insert(at, (lo, hi))
    return out


def _failed(verb: str, e: BaseException) -> Answer:
    """The answer of an engine step that raised: 500, the error's class and fields (engine, rank,
    parameter, hint) kept for the caller's typed exception."""
    logger.error("%s failed in the engine: %s: %s", verb, type(e).__name__, e, exc_info=e)
    typed = isinstance(e, P2PWeightsError)
    what = e.message if typed else str(e)
    return Answer(p.ENGINE_FAILED, error_payload(f"{verb} failed in the engine: {type(e).__name__}: {what}",
                                                 type_name=type(e).__name__ if typed else None,
                                                 **(e.fields() if typed else {})))


def _why(answer: Answer) -> str:
    body = answer.body
    if isinstance(body, dict):
        return str(body.get("message") or body.get("error") or body)[:300]
    return str(body)[:300]
