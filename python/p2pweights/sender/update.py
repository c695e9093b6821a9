"""One weight update in flight: it only orchestrates the slot pipeline and the senders' steps.

update():  the version checks (this sender's last version, the engines' current one) -> the
           senders agree (group.py).
push:      inputs (tied, DTensor, cast, finite; inputs.py) -> stage (until a parameter group is
           complete; name, shape, dtype checked) -> transform -> at the first push that passed
           every check, sender 0 pauses the engines -> place into a slot (the pipeline loads and
           hands slots to the writer). With P2PW_OPEN_BESIDE_SLOTS=1, a sender alone (no group)
           opens their session (begin) on a thread while its loaders fill the first slots; the
           first slot reaches the writer only once every engine's session is open (open_gate.py),
           and when opening failed no slot ever does.
finish:    drain the pipeline, wait for every write (meanwhile sender 0's last lease check-in),
           every sender's writes returned -> sender 0 ends the session, bumps the version and
           continues generation, each engine on its own as soon as it ended.
A failure anywhere releases every slot and tells no engine to end; then the failure policy
(``on_failure``): before any write of any sender the engines end the session without a version
bump and generate again (``FailurePolicy.RESUME_IF_UNWRITTEN``, the default); after a write they
stay paused with their session open and their old version, and the next complete update heals them.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..control import FailurePolicy, SglangEngine, UpdateSession
from ..control.engine_calls import call_engines, recording_verbs
from ..control.protocol import PAUSE_MODES
from ..copyplans import ReplayOrder
from ..errors import P2PWeightsError, SenderGroupError, UpdateFailed
from ..settings import value as setting
from . import apply_beside
from .bulk_push import push_fused, push_many
from .fillers import FillerChoice, SlotHandOver
from .group import SenderGroup, SenderStatus, all_failures, others_failures
from .inputs import TrainerInputs, check_version_order
from .isolate import isolate_failed_engines
from .open_gate import OpenGate
from .outcomes import KEPT_PAUSED, LEFT_PAUSED, NOT_CONTROLLED, ON_FAILURE, ROLLED_BACK, UNTOUCHED, control_failures
from .pipeline import SlotPipeline
from .prepared import PreparedRank
from .report import UpdateReport, UpdateTimes
from .slot_producer import SlotProducer
from .transforms import GroupLoad, GroupTransform, apply_transforms
from .update_report import build_report
from .verify import WrittenDigests, verify_update
from .write_fence import fence_engine, follow_epochs
from .writer import PipelinedWriter, WriteReport

logger = logging.getLogger("p2pweights.sender")


class Update:
    """One weight update: push() every HF tensor of this sender's stage, then finish().

    ``outcome`` says, after a failure, what happened to the engines (one of the module's notes).
    """

    def __init__(self, ranks: Sequence[PreparedRank], engines: Sequence[SglangEngine], writer: PipelinedWriter,
                 version: Any, *, control: bool = True, transforms: Sequence[GroupTransform] = (),
                 staging_for: Callable[[Any], Any] | None = None, group: SenderGroup | None = None,
                 inputs: TrainerInputs | None = None, pause_mode: str = "abort",
                 on_failure: str | FailurePolicy = FailurePolicy.RESUME_IF_UNWRITTEN,
                 previous_version: str | None = None, force: bool = False,
                 metrics: Any = None, on_success: Callable[["Update"], None] | None = None, verify: bool = False,
                 owner: str | None = None, lease: float | None = None, copy_plans: str = "on",
                 open_beside_slots: bool | None = None, replay_order: ReplayOrder | None = None,
                 follow_epochs: Callable[[dict[str, int], dict[str, str]], list[str]] | None = None,
                 deltas: Any = None):
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {', '.join(PAUSE_MODES)}, got {pause_mode!r}")
        self.version = str(version)
        self._ranks = list(ranks)
        self._engines = list(engines)
        self._writer = writer
        self._transforms = tuple(transforms)
        self._group = group or SenderGroup()
        self._inputs = inputs
        self._on_failure = FailurePolicy.parse(on_failure, ON_FAILURE)
        self._metrics = metrics
        self._on_success = on_success
        self._follow_epochs = follow_epochs  # re-attaches ranks whose epoch moved on (write_fence.py)
        self._controls = control and self._group.controller
        self._open_beside = setting("P2PW_OPEN_BESIDE_SLOTS", open_beside_slots)  # the sender's keyword, else the variable
        self.times = UpdateTimes()
        self._gate = OpenGate(writer)  # every slot reaches the writer through it (held while opening)
        handover = self._handover = SlotHandOver(self._gate, self.times)
        # groups with a verified copy plan are replayed, the others loaded (and, copy_plans="on", recorded):
        # slot_producer.py; the sender's replay order keeps what turned off across its updates
        producer = SlotProducer(self.times, replay_order or ReplayOrder(), mode=copy_plans)
        self.pipeline = SlotPipeline(handover, FillerChoice(handover, staging_for, producer), self.times)
        self._digests = WrittenDigests() if verify else None  # verify=True: what each slot held, per parameter
        self.pipeline.digests = self._digests
        self._deltas = self.pipeline.deltas = deltas  # a delta_writes.UpdateDeltas: delta records where accepted
        self._beside: apply_beside.AppliesBeside | None = None  # applies deltas as their slots' writes return
        self.pipeline.fuse_compare = not self._transforms  # a transform's tensors (FP8 quantize-on-send): the slot
        self.verify_seconds = 0.0
        # owner: the sender's one controller id, so that its next update may resume a session this
        # one left open on an sglang server (which cannot say whose a session is)
        self._session = (UpdateSession(self._engines, self.version, pause_mode=pause_mode, owner=owner,
                                       lease=lease, on_failure=self._on_failure)
                         if self._controls else None)
        if self._session is not None:  # the data plane obeys the session: no post past the lease
            self._session.renewer.on_deadline = self._fence_writes
        self.report: UpdateReport | None = None
        self.outcome = ""
        self._phase = "new"  # new -> [opening ->] open -> done | failed
        self._opener: threading.Thread | None = None  # pause + begin on a thread (a sender alone)
        self._open_error: BaseException | None = None
        self._pipeline_raised = False
        self._verbs: dict[str, float] = {}
        self._validate_seconds = self._pause_seconds = 0.0
        self._t0 = time.perf_counter()
        for p in self._ranks:
            p.stager.reset()
        self._start(control, previous_version, force)

    # -- the steps every sender takes -------------------------------------------------------------
    def _start(self, control: bool, previous_version: str | None, force: bool) -> None:
        """Version checks, then the senders agree (or every one of them raises)."""
        t0 = time.perf_counter()
        error: BaseException | None = None
        try:
            engine_versions: dict[str, str] = {}
            if self._controls and not force:
                calls = call_engines(self._engines, "weight_version")
                calls.raise_for_errors()
                engine_versions = calls.results
            check_version_order(self.version, previous_version, engine_versions, force=force)
        except P2PWeightsError as e:
            error = e
        me = self._group.index
        why = {f"sender {me}": f"{type(error).__name__}: {error}"} if error is not None else {}
        statuses = self._gather(SenderStatus(me, why, version=self.version, control=bool(control)))
        if error is not None:
            self._phase = "failed"
            raise error
        others = others_failures(statuses, me)
        if others:
            self._phase = "failed"
            raise UpdateFailed(others, what=f"starting weight update {self.version}")
        versions = {s.version for s in statuses}
        if len(versions) > 1 or len({s.control for s in statuses}) > 1:
            self._phase = "failed"
            raise SenderGroupError(
                f"the senders of the group disagree on update({sorted(versions)}, control="
                f"{sorted({s.control for s in statuses})}): every sender of a group must call update() with "
                f"the same version and control", hint="call sender.update(step) with one step on every rank")
        self._validate_seconds = time.perf_counter() - t0
        logger.info("update %s: validated the version on %d sender(s) in %.3f s", self.version, len(statuses),
                    self._validate_seconds)

    def _open(self) -> None:
        """Every sender's first push passed its checks: sender 0 pauses the engines and opens their
        session; nobody writes before it did."""
        t0 = time.perf_counter()
        me = self._group.index
        statuses = self._gather(SenderStatus(me))
        others = others_failures(statuses, me)
        if others:
            self._phase, self.outcome = "failed", UNTOUCHED
            raise self._failed(others, f"weight update {self.version}", UNTOUCHED)
        self._validate_seconds += self.times.staging  # the first pushes' checks, before the pause
        error: Exception | None = None
        if self._session is not None:
            try:
                self._control(self._open_session)  # pause + begin (+ the epochs followed)
            except Exception as e:  # noqa: BLE001 - the others learn it at the next step, then it is raised
                error = e
        epochs = dict(self._session.epochs) if self._session is not None else {}
        instances = dict(self._session.instances) if self._session is not None else {}
        said = self._deltas.said(self._engines) if self._deltas is not None and self._session is not None else {}
        statuses = self._gather(SenderStatus(me, control_failures(error), epochs=epochs, instances=instances,
                                             deltas=said, owner=apply_beside.offer(self._session)))
        if error is not None:
            self._phase, self.outcome = "failed", UNTOUCHED
            raise error
        failures = all_failures(statuses)
        if failures:
            self._phase, self.outcome = "failed", UNTOUCHED
            raise self._failed(failures, f"opening weight update {self.version}", UNTOUCHED)
        if self._session is None:  # not the controller: the controller's epochs (and deltas), before the first write
            self.begin_instances = {n: i for s in statuses for n, i in s.instances.items()}  # isolate.py reads them
            follow_epochs({n: e for s in statuses for n, e in s.epochs.items()}, self._follow_epochs, self._writer,
                          self._ranks, None, self.begin_instances)
            if self._deltas is not None:
                self._deltas.follow({n: w for s in statuses for n, w in s.deltas.items()})
        self._phase = "open"
        self._beside = apply_beside.start(self._deltas, self._session, self._writer, self._engines, self._handover,
                                          self.pipeline, statuses)
        self._pause_seconds = time.perf_counter() - t0
        # The time users care about runs from pause_generation returning to the update returning.
        self._t0 = self._session.paused_at if self._session is not None else time.perf_counter()
        if self._session is not None:
            logger.info("update %s: paused and opened %d engine(s) in %.3f s (%s)", self.version, len(self._engines),
                        self._pause_seconds, self._verbs_text("pause_generation", "_begin"))

    def _open_soon(self) -> None:
        """A sender alone: pause the engines (waited for), then open their session on a thread while
        this thread goes on filling slots; the gate holds the first slot until every engine's session
        is open.
        (A sender of a group opens at once, in step with the others: its group's collectives must
        run in the same order on every sender.)"""
        self._phase = "opening"
        self._validate_seconds += self.times.staging  # the first pushes' checks, before the pause
        self._gate.close()
        t0 = time.perf_counter()
        paused = threading.Event()  # pause_generation answered (or the opening ended before it)
        self._session.on_paused = paused.set

        def run() -> None:
            try:
                self._control(self._open_session)  # pause + begin (+ the epochs followed)
            except BaseException as e:  # noqa: BLE001 - raised by _opened(), on the trainer's thread
                self._open_error = e
                self._gate.failed()
            else:
                self._gate.opened()
            finally:
                self._pause_seconds = time.perf_counter() - t0
                paused.set()

        self._opener = threading.Thread(target=run, name=f"p2pw-open-{self.version}", daemon=True)
        self._opener.start()
        paused.wait()  # as for a sender of a group: the first good push returns with the engines paused

    def _open_session(self) -> None:
        """pause + begin; then the ranks whose epoch moved on re-attached (write_fence.py; a failure
        rolls the session back: nothing was written)."""
        if self._deltas is not None:
            self._deltas.claim(self._engines)  # a begin body per engine: its delta claim
        self._session.open()
        try:
            if self._deltas is not None:
                self._deltas.opened(self._session.answers)
            follow_epochs(self._session.epochs, self._follow_epochs, self._writer, self._ranks, self._session,
                          self._session.instances)
        except BaseException as e:
            self._session.roll_back(f"{type(e).__name__}: {e}")
            raise

    def _opened(self, wait: bool = True) -> None:
        """The opening is over (``wait``: wait for it; else only when it is): the update is open, or
        its error is raised with nothing written (the slots produced meanwhile are released; the
        session's own roll-back resumed what it had paused)."""
        if self._phase != "opening" or (not wait and self._opener.is_alive()):
            return
        self._opener.join()
        if self._open_error is not None:
            self._phase, self.outcome = "failed", UNTOUCHED
            try:
                self.pipeline.abort()
            finally:
                self._writer.finish(raise_on_failure=False)
            self._count_failure(control_failures(self._open_error))
            raise self._open_error
        self._phase = "open"
        self._beside = apply_beside.start(self._deltas, self._session, self._writer, self._engines, self._handover,
                                          self.pipeline)
        self._t0 = self._session.paused_at  # the time users care about runs from the pause returning
        logger.info("update %s: paused and opened %d engine(s) in %.3f s beside the first slots (%s)", self.version,
                    len(self._engines), self._pause_seconds, self._verbs_text("pause_generation", "_begin"))

    # -- the trainer's calls ----------------------------------------------------------------------
    def __enter__(self) -> "Update":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finish()
        elif self._phase in ("new", "opening", "open"):
            self._abort(exc)
            if isinstance(exc, BaseException):
                self._note(exc)

    def push(self, hf_name: str, tensor: Any) -> None:
        """Stage one full HF tensor (CPU or GPU, any order; a DTensor is gathered); complete groups
        are transformed and placed in a slot at once. A refused push (bad name, shape, dtype,
        NaN) leaves the update as it was: push the right tensor, or leave the block to fail it."""
        self._require_active()
        t0 = time.perf_counter()
        if self._inputs is not None:
            tensor = self._inputs.prepare(hf_name, tensor)
            if tensor is None:
                return  # a tied name: the engine loads nothing from it
        loads: list[GroupLoad] = []
        for p in self._ranks:
            done = p.stager.push(hf_name, tensor)
            if done is not None:
                group_index, tensors = done
                loads += apply_transforms(self._transforms, GroupLoad(p, p.replica.groups[group_index], tensors))
        self._place(loads, t0)

    def _place(self, loads: list[GroupLoad], t0: float) -> None:
        """Groups completed by pushes staged since ``t0``: open the session at the first, place them."""
        self.times.staging += time.perf_counter() - t0
        if self._phase == "new":
            if self._session is not None and self._group.size == 1 and self._open_beside:
                self._open_soon()
            else:
                self._open()
        try:
            for load in loads:
                self.pipeline.place(load)
        except BaseException:
            self._pipeline_raised = True  # a slot may have reached the writer
            raise
        self._opened(wait=False)  # an opening that failed fails the update now

    def push_many(self, named_tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> None:
        """push() of every (name, tensor) of a dict or pairs, in order: the bulk path (bulk_push.py)."""
        push_many(self, named_tensors)

    def push_fused(self, names: Sequence[str], tensor: Any) -> None:
        """push_many(zip(names, tensor.unbind(0))): experts stacked on dim 0, pushed as views."""
        push_fused(self, names, tensor)

    def finish(self) -> UpdateReport:
        """Waits for every write of every sender; then sender 0 ends the update and bumps the
        version on every engine. Raises MissingTensors or UpdateFailed (naming each failed engine
        or sender, and saying what became of the engines) otherwise."""
        if self._phase == "done":
            return self.report
        self._require_active()
        try:
            for p in self._ranks:
                p.stager.check_complete()
            if self._phase == "new":
                self._open()
            try:
                self.pipeline.drain()
            except BaseException:
                self._pipeline_raised = True
                raise
            self._opened()
            if self._session is not None:
                self._session.check_in_soon()  # beside the last writes
        except BaseException as e:
            if self._phase in ("new", "opening", "open"):
                self._abort(e)
                self._note(e)
            raise
        t0 = time.perf_counter()
        rep: WriteReport = self._writer.finish(raise_on_failure=False)
        # a refused apply beside the writes tore its engine: not ended
        torn = apply_beside.finish(self._beside, self._handover, self.pipeline)
        self.times.waiting += time.perf_counter() - t0
        data_seconds = time.perf_counter() - self._t0
        logger.info("update %s: writes done: %d bytes to %d engine rank(s) in %.3f s", self.version, rep.bytes,
                    len(rep.engines), data_seconds)
        me = self._group.index
        differ = verify_update(self, rep)  # verify=True: before any engine is told to end (it stays paused)
        # weights that differ count as written: memory known to differ is never resumed (rolled back)
        statuses = self._gather(SenderStatus(me, {**rep.failures, **torn, **{n: str(e) for n, e in differ.items()}},
                                             written=self._written or bool(differ),
                                             deltas=self._deltas.written() if self._deltas is not None else {}))
        failures = all_failures(statuses) if differ else isolate_failed_engines(self, all_failures(statuses))
        if failures:
            self._end_failed(statuses, "; ".join(f"{n}: {why}" for n, why in failures.items()))
            raise self._failed({**failures, **differ}, f"weight update {self.version}", self.outcome, rep)
        error: Exception | None = None
        if self._session is not None:
            try:
                if self._deltas is not None:  # the delta engines' end bodies: every sender's manifests
                    self._deltas.manifests(self._engines, [s.deltas for s in statuses if s.sender != me])
                self._control(self._session.commit)  # end_weight_update, update_weight_version, continue_generation
            except Exception as e:  # noqa: BLE001 - the others learn it at the next step, then it is raised
                error = e
            logger.info("update %s: ended, versioned and continued %d engine(s): %s", self.version,
                        len(self._engines), self._verbs_text("end_weight_update", "update_weight_version",
                                                              "continue_generation"))
        identities = {}  # the identities the ends answered: the next update's claims, every sender's
        if self._deltas is not None and self._session is not None:
            identities = self._deltas.committed(self._engines, self._session.answers, ok=error is None)
        statuses = self._gather(SenderStatus(me, control_failures(error), deltas=identities))
        if self._deltas is not None and self._session is None:
            self._deltas.follow_commit({n: i for s in statuses for n, i in s.deltas.items()},
                                       ok=error is None and not all_failures(statuses))
        self._phase = "done"
        failures = all_failures(statuses)
        if error is not None or failures:
            self._phase, self.outcome = "failed", "finishing the update failed on the engines named"
            self._count_failure(failures)
            if error is not None:
                raise error
            raise self._failed(failures, f"finishing weight update {self.version}", self.outcome, rep)
        seconds = time.perf_counter() - self._t0
        self.report = self._report(rep, seconds, data_seconds, len(statuses))
        if self._metrics is not None:
            self._metrics.succeeded(seconds, {e.engine: e.bytes for e in self.report.engines})
        logger.info("update %s: done in %.3f s (%d bytes)", self.version, seconds, rep.bytes)
        if self._on_success is not None:
            self._on_success(self)
        return self.report

    def abort(self, reason: str = "abandoned by the caller") -> str:
        """Give the update up (as leaving its block on an error does); returns ``outcome``."""
        if self._phase in ("new", "opening", "open"):
            self._abort(P2PWeightsError(reason))
        return self.outcome

    # -- failure ------------------------------------------------------------------------------------
    @property
    def _written(self) -> bool:
        return self.times.slots > 0 or self._pipeline_raised

    def _abort(self, error: BaseException) -> None:
        """This sender failed (``error``): release its slots, then take the step the others are at."""
        me = self._group.index
        why = {f"sender {me}": f"{type(error).__name__}: {error}"}
        if self._phase == "opening":
            try:
                self._opened()  # raises when the opening failed: then nothing was written, as said
            except BaseException:  # noqa: BLE001 - the caller raises its own error
                return
        if self._phase == "new":  # the others wait for our first push, at the ready step
            self._phase, self.outcome = "failed", UNTOUCHED
            self._gather(SenderStatus(me, why))
            self._count_failure(why)
            return
        try:
            self.pipeline.abort()
        finally:
            self._writer.finish(raise_on_failure=False)  # every write returned before the slots are reused
            apply_beside.finish(self._beside, self._handover, self.pipeline)
        statuses = self._gather(SenderStatus(me, why, written=self._written))
        self._end_failed(statuses, str(error))

    def _end_failed(self, statuses: list[SenderStatus], reason: str) -> None:
        """Sender 0 applies the failure policy and tells the others what became of the engines."""
        self._phase = "failed"
        note = ""
        if self._session is not None:
            written = any(s.written for s in statuses)
            # the session applies the policy: rolled back only when nothing was written (RESUME_IF_UNWRITTEN)
            self._control(lambda: self._session.abort(reason, written=written))
            rolled_back = not written and self._on_failure is FailurePolicy.RESUME_IF_UNWRITTEN
            note = ROLLED_BACK if rolled_back else LEFT_PAUSED if written else KEPT_PAUSED
            failed = {n: str(e) for n, e in self._session.errors.items()}
            if failed:
                note += f" (control calls failed on {', '.join(sorted(failed))})"
        me = self._group.index
        ended = self._gather(SenderStatus(me, note=note))
        self.outcome = note or next((s.note for s in ended if s.note), "") or NOT_CONTROLLED
        self._count_failure(all_failures(statuses))
        logger.warning("update %s failed: %s", self.version, self.outcome)

    def _failed(self, failures: dict[str, str], what: str, outcome: str, report: Any = None) -> UpdateFailed:
        err = UpdateFailed(failures, report, what=what)
        err.args = (f"{err.message}\n  engines: {outcome}",)
        return err

    def _count_failure(self, failures: Any) -> None:
        if self._metrics is not None and failures:
            self._metrics.failed(failures)

    def _require_active(self) -> None:
        if self._phase == "failed":
            raise P2PWeightsError(f"update {self.version} already failed ({self.outcome}); start a new update")
        if self._phase == "done":
            raise P2PWeightsError(f"update {self.version} already finished; start a new update")

    def _note(self, exc: BaseException) -> None:
        """The error says what became of the engines (Python >= 3.11 prints notes under it)."""
        if self.outcome and self.outcome not in str(exc) and hasattr(exc, "add_note"):
            exc.add_note(f"p2pweights: update {self.version} failed; {self.outcome}")

    def _gather(self, status: SenderStatus) -> list[SenderStatus]:
        try:
            return self._group.gather(status)
        except Exception as e:  # noqa: BLE001 - a sender died or the group timed out
            self._phase = "failed"
            self.outcome = (f"the senders' group broke ({type(e).__name__}: {e}); engines a session was opened on "
                            f"stay paused with it open")
            raise UpdateFailed({"sender group": str(e)}, what=f"weight update {self.version}") from e

    # -- bookkeeping --------------------------------------------------------------------------------
    def _control(self, verb: Callable[..., Any], *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            with recording_verbs() as log:
                return verb(*args)
        finally:
            self.times.control += time.perf_counter() - t0
            for name, seconds, _ in log:
                self._verbs[name] = self._verbs.get(name, 0.0) + seconds

    def _verbs_text(self, *names: str) -> str:
        return ", ".join(f"{n.strip('_')} {self._verbs[n]:.3f} s" for n in names if n in self._verbs)

    def _fence_writes(self, engine: str, deadline: float) -> None:
        fence_engine(self._writer, self._ranks, engine, deadline)

    def _report(self, rep: WriteReport, seconds: float, data_seconds: float, senders: int) -> UpdateReport:
        return build_report(self.version, self._ranks, rep, self.times, seconds=seconds, data_seconds=data_seconds,
                            senders=senders, validate_seconds=self._validate_seconds,
                            pause_seconds=self._pause_seconds, deltas=self._deltas, buffers=self._writer.buffers,
                            skipped=list(self._inputs.skipped) if self._inputs is not None else [],
                            verbs={n.strip("_"): s for n, s in self._verbs.items()}, beside=self._beside)
