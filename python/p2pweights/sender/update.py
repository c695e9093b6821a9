"""One weight update in flight: it only orchestrates the slot pipeline.

push: stage (until a parameter group is complete) → transform → place into a slot (the pipeline
loads and hands slots to the writer); finish: drain the pipeline, wait for every write, then end
the engines' update session. Any failure releases every slot and tells no engine to end.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Sequence

from ..control import SglangEngine, UpdateSession
from ..errors import P2PWeightsError, UpdateFailed
from .fillers import FillerChoice, SlotHandOver
from .pipeline import SlotPipeline
from .prepared import PreparedRank
from .report import EngineRankReport, UpdateReport, UpdateTimes
from .transforms import GroupLoad, GroupTransform, apply_transforms
from .writer import PipelinedWriter, WriteReport


class Update:
    """One weight update: push() every HF tensor of this sender's stage, then finish()."""

    def __init__(self, ranks: Sequence[PreparedRank], engines: Sequence[SglangEngine], writer: PipelinedWriter,
                 version: Any, *, control: bool = True, transforms: Sequence[GroupTransform] = (),
                 staging_for: Callable[[Any], Any] | None = None):
        self.version = str(version)
        self._ranks = list(ranks)
        self._writer = writer
        self._transforms = tuple(transforms)
        self.times = UpdateTimes()
        handover = SlotHandOver(writer, self.times)
        self.pipeline = SlotPipeline(handover, FillerChoice(handover, staging_for), self.times)
        self._session: UpdateSession | None = None
        self.report: UpdateReport | None = None
        self._finished = False
        for p in self._ranks:
            p.stager.reset()
        if control:
            t0 = time.perf_counter()
            self._session = UpdateSession(list(engines), self.version)
            self._session.open()  # pause + begin
            self.times.control += time.perf_counter() - t0
        # The time users care about runs from pause_generation returning to the update returning.
        self._t0 = self._session.paused_at if self._session is not None else time.perf_counter()

    def __enter__(self) -> "Update":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.finish()
        elif not self._finished:
            self._abort(f"{exc_type.__name__}: {exc}")

    def push(self, hf_name: str, tensor: Any) -> None:
        """Stage one full HF tensor (CPU or GPU, any order); complete groups are transformed and
        placed in a slot at once."""
        t0 = time.perf_counter()
        loads: list[GroupLoad] = []
        for p in self._ranks:
            done = p.stager.push(hf_name, tensor)
            if done is not None:
                group_index, tensors = done
                loads += apply_transforms(self._transforms, GroupLoad(p, p.replica.groups[group_index], tensors))
        self.times.staging += time.perf_counter() - t0
        for load in loads:
            self.pipeline.place(load)

    def push_many(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        for name, t in named_tensors:
            self.push(name, t)

    def finish(self) -> UpdateReport:
        """Waits for every write; then (with control) ends the update and bumps the version on every
        engine. Raises MissingTensors or UpdateFailed (naming each failed engine) otherwise."""
        if self._finished:
            if self.report is None:
                raise P2PWeightsError("this update already failed")
            return self.report
        try:
            for p in self._ranks:
                p.stager.check_complete()
            self.pipeline.drain()
        except BaseException as e:
            self._abort(str(e))
            raise
        t0 = time.perf_counter()
        rep: WriteReport = self._writer.finish(raise_on_failure=False)
        self.times.waiting += time.perf_counter() - t0
        if rep.failures:
            self._abort("; ".join(f"{n}: {why}" for n, why in rep.failures.items()))
            raise UpdateFailed(rep.failures, rep)
        data_seconds = time.perf_counter() - self._t0
        if self._session is not None:
            t0 = time.perf_counter()
            self._session.commit()  # end_weight_update, update_weight_version, continue_generation
            self.times.control += time.perf_counter() - t0
        seconds = time.perf_counter() - self._t0
        self._finished = True
        self.report = self._report(rep, seconds, data_seconds)
        return self.report

    def _report(self, rep: WriteReport, seconds: float, data_seconds: float) -> UpdateReport:
        by_id = {e.engine: e for e in rep.engines}
        engines = []
        for p in self._ranks:
            for t in p.targets:
                e = by_id[t.writer_id]
                engines.append(EngineRankReport(t.engine.name, t.rank, e.bytes, e.seconds, e.gbps, e.state, e.error))
        tm = self.times
        return UpdateReport(self.version, seconds, rep.bytes, tm.groups, tm.slots, tm.staging, tm.loading,
                            max((e.seconds for e in rep.engines), default=0.0), tm.waiting, tm.control, engines,
                            data_seconds)

    def _abort(self, reason: str) -> None:
        self._finished = True
        try:
            self.pipeline.abort()
        finally:
            self._writer.finish(raise_on_failure=False)  # every write returned before the slots are reused
            if self._session is not None:
                self._session.abort(reason)
