"""Producing a slot's bytes: replayed copy plans where a group has a verified one, else the loaders.

The first time a replica's group is loaded, its loaders run (the loader path) and its copy plan is
recorded (p2pweights.copyplans) and replayed once into scratch memory with the same inputs: only
a plan whose bytes equal the loaders' byte for byte is kept. From then on the group is produced
by replaying its plan, without calling a Python loader. A group whose loaders compute (a dtype
change, arithmetic, a derived tensor) or whose first replay differed stays on the loader path
for good (its reason is kept in :attr:`~p2pweights.copyplans.ReplicaPlans.refused`).

Plans live with their replica, in this process, and in ``P2PW_REPLICA_CACHE_DIR`` next to the
replica's loader mapping (copyplans/store.py): a process that finds them there does not record
again, but treats each as unverified — the group's first load runs the loaders and the plan's
replay must equal their bytes, or the plan is dropped and recorded afresh. A new shard layout or a
rebuilt replica has another key, so a changed layout drops them.

``P2PW_COPY_PLANS`` (``copy_plans=``): ``on`` records on the update path as above; ``background``
(the default) records off it, in the sender's :class:`~p2pweights.copyplans.PlanRecorder`
thread after ``connect``, from the HF specs alone: its plans start unverified, like plans from disk,
and a group without a plan yet only runs its loaders (nothing is recorded on the update path);
``off`` keeps every group on the loader path. The recorder and an update never run one replica's
loaders at once (they re-point its parameters): :attr:`ReplicaPlans.loaders` is held per loader run
by the recorder and per loader batch by the update. Replayed groups go to the sender's
:class:`~p2pweights.copyplans.ReplayOrder` (one native call per slot; its fallbacks are its own).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Sequence

from ..copyplans import GroupPlan, NotACopy, ReplayOrder, ReplicaPlans, differing_parameters, plans_of, record_group_plan
from ..replica.groups import ParameterGroup, SlotRegion
from .report import UpdateTimes

logger = logging.getLogger("p2pweights.sender")


class SlotProducer:
    """Fills one engine rank's placed groups into a slot: replay or loaders (see the module)."""

    def __init__(self, times: UpdateTimes, order: ReplayOrder | None = None, enabled: bool = True, mode: str = "on"):
        self.times = times  # counts: replayed, loader_groups, recorded, record_seconds
        self.order = order if order is not None else ReplayOrder()
        self.mode = mode if enabled else "off"  # P2PW_COPY_PLANS: on | background | off
        self.enabled = self.mode != "off"

    def __call__(self, rank: Any, placed: Sequence[tuple[ParameterGroup, int]], tensors: Mapping[str, Any],
                 target: Any, deferred: list | None = None) -> list[SlotRegion]:
        """The placed groups' regions, their bytes in ``target``; with a ``deferred`` list, the replayed
        groups of a host slot are not run but appended to it as one
        :class:`~p2pweights.copyplans.DeferredReplay` (the delta compare reads their inputs; the
        caller runs what it needs in the slot)."""
        replica = rank.replica
        plans = plans_of(replica)
        if not self.enabled:
            self.times.loader_groups += len(placed)
            with plans.loaders:
                return replica.load_groups(placed, tensors, target)
        replay: list[tuple[ParameterGroup, int, GroupPlan]] = []
        load: list[tuple[ParameterGroup, int]] = []
        check: dict[int, GroupPlan] = {}  # unverified plans (disk, recorder), checked against the loaders' bytes
        other: dict[int, bool] = {}  # groups whose plan was recorded for inputs of other shapes or dtypes
        for group, offset in placed:
            plan = plans.plans.get(group.index)
            if plan is not None and plan.accepts(tensors):
                replay.append((group, offset, plan))
                continue
            with plans.lock:
                if plan is not None:  # inputs changed shape or dtype (another transform): record again
                    plans.plans.pop(group.index, None)
                stored = plans.unverified.pop(group.index, None)
            if stored is not None and stored.accepts(tensors):
                check[group.index] = stored
            elif stored is not None or plan is not None:
                other[group.index] = True  # recorded for other inputs: only this path can record it again
            load.append((group, offset))
        by_group: dict[int, list[SlotRegion]] = {}
        if load:
            with plans.loaders:  # the background recorder waits (it re-points the same parameters)
                loaded = replica.load_groups(load, {n: tensors[n] for g, _ in load for n in g.hf_names}, target)
            for group, offset in load:
                by_group[group.index] = [r for r in loaded if offset <= r.offset < offset + group.nbytes]
            self.times.loader_groups += len(load)
            recorded = self.times.recorded
            for group, offset in load:
                if group.index in check and self._verify(plans, group, offset, check[group.index], tensors, target):
                    continue
                if plans.known(group.index):
                    continue
                if self.mode == "on" or group.index in other:
                    with plans.loaders:
                        self._record(replica, plans, group, offset, tensors, target)
                elif group.index in check:  # background: a recorded plan that differs stays refused
                    with plans.lock:
                        plans.refused[group.index] = "its recorded plan's replay differs from the loaders"
            if self.times.recorded != recorded:
                plans.save()
        # the slot's replayed groups in one native call (per-group calls cost ~15 us of Python
        # each, the bound of a GPU slot)
        if replay:
            joined = [(plan, offset) for _, offset, plan in replay]
            later = self.order.defer_slot(joined, tensors, target) if deferred is not None else None
            if later is None:
                self.order.replay_slot(joined, tensors, target)
            else:
                deferred.append(later)
            for group, offset, plan in replay:
                by_group[group.index] = plan.regions_at(offset)
        self.times.replayed += len(replay)
        return [r for group, _ in placed for r in by_group[group.index]]

    def _verify(self, plans: ReplicaPlans, group: ParameterGroup, offset: int, plan: GroupPlan,
                tensors: Mapping[str, Any], target: Any) -> bool:
        """A plan read from disk is kept only if its replay equals what the loaders just wrote."""
        t0 = time.perf_counter()
        inputs = {n: tensors[n] for n in group.hf_names}
        try:
            ok = not differing_parameters(plan, target, offset, inputs, self.order)
        except Exception:  # noqa: BLE001 - a damaged plan (bounds, shapes): record it again
            ok = False
        with plans.lock:
            if ok:
                plans.plans[group.index] = plan
                plans.refused.pop(group.index, None)
            else:
                plans.dropped += 1
                logger.warning("the unverified copy plan of group %d (%s) differs from its loaders: %s",
                               group.index, group.params[0],
                               "recording it again" if self.mode == "on" else "the group stays on the loader path")
        self.times.record_seconds += time.perf_counter() - t0
        return ok

    def _record(self, replica: Any, plans: ReplicaPlans, group: ParameterGroup, offset: int,
                tensors: Mapping[str, Any], target: Any) -> None:
        """Record the group's plan and check its first replay against what the loaders just wrote."""
        t0 = time.perf_counter()
        inputs = {n: tensors[n] for n in group.hf_names}
        try:
            plan = record_group_plan(replica, group, inputs, device=target.device)
            differ = differing_parameters(plan, target, offset, inputs, self.order)
            why = f"the first replay differs from the loaders in {', '.join(differ[:4])}" if differ else ""
        except NotACopy as e:
            plan, why = None, str(e)
        except Exception as e:  # noqa: BLE001 - recording only saves time: the loaders' bytes stand
            plan, why = None, f"recording failed ({type(e).__name__}: {e})"
        with plans.lock:
            if why:
                plans.refused[group.index] = why
                logger.info("group %d (%s) stays on the loader path: %s", group.index, group.params[0], why)
            else:
                plans.plans[group.index] = plan
                self.times.recorded += 1
        self.times.record_seconds += time.perf_counter() - t0
