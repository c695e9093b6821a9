"""Where copy plans are kept: with their replica in this process (:class:`ReplicaPlans`, one per
replica: verified plans, unverified ones, refusals) and on disk next to the replica's cached loader
mapping (``P2PW_REPLICA_CACHE_DIR``).

Recording a replica's plans costs seconds (the loaders run on index-encoded inputs, once or twice
per group); a process that finds them on disk skips that. One file per replica, named and stamped
with the replica key's digest (model config hash, layout, rank, role, sglang and package versions)
and :data:`PLAN_FORMAT`. A file is untrusted: an entry whose format, key, group (HF names, regions,
element sizes) or native check (program.py: bounds and overlaps) do not match is dropped and
recorded again, and a plan that passes still has its first replay checked byte for byte against the
loaders (sender/slot_producer.py) before any slot gets its bytes from it.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..replica.groups import ParameterGroup, SlotRegion
from .group_plan import GroupPlan
from .program import program_of

if TYPE_CHECKING:
    from ..replica.model_replica import ModelReplica

logger = logging.getLogger("p2pweights.copyplans")

PLAN_FORMAT = 1  # bump when GroupPlan's ops or this file's layout change


def plan_path(replica: "ModelReplica") -> str | None:
    """Where ``replica``'s plans live, or None (no cache folder, or a replica without a key)."""
    folder = getattr(replica, "plan_cache_dir", None)
    key = getattr(replica, "key", None)
    if not folder or key is None:
        return None
    return os.path.join(folder, f"plans-v{PLAN_FORMAT}-{key.digest()}.json")


def _plan_json(plan: GroupPlan) -> dict[str, Any]:
    return {
        "inputs": list(plan.inputs),
        "input_specs": [[list(shape), dtype] for shape, dtype in plan.input_specs],
        "regions": [[r.param_name, r.offset, r.nbytes] for r in plan.regions],
        "itemsizes": list(plan.itemsizes),
        "ops": [[inp, reg, d, s, list(n), list(ds), list(ss)] for inp, reg, d, s, n, ds, ss in plan.ops],
    }


def save_plans(path: str, digest: str, plans: Mapping[int, GroupPlan], refused: Mapping[int, str]) -> None:
    """Write the plans (and the groups refused, with why) atomically."""
    body = {"format": PLAN_FORMAT, "replica": digest,
            "plans": {str(i): _plan_json(p) for i, p in plans.items()},
            "refused": {str(i): why for i, why in refused.items()}}
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(body, f)
    os.replace(tmp, path)


def _plan_of(group: ParameterGroup, itemsizes: Sequence[int], body: Mapping[str, Any]) -> GroupPlan:
    """The stored plan of ``group``, or ValueError/KeyError/TypeError if it is not the group's."""
    regions = tuple(SlotRegion(str(n), int(o), int(b)) for n, o, b in body["regions"])
    if tuple(body["inputs"]) != tuple(group.hf_names) or regions != tuple(group.regions):
        raise ValueError("the plan is of another group")
    if tuple(body["itemsizes"]) != tuple(itemsizes):
        raise ValueError("the plan's element sizes are not the group's")
    specs = tuple((tuple(int(x) for x in shape), str(dtype)) for shape, dtype in body["input_specs"])
    ops = [(int(i), int(r), int(d), int(s), tuple(int(x) for x in n), tuple(int(x) for x in ds),
            tuple(int(x) for x in ss)) for i, r, d, s, n, ds, ss in body["ops"]]
    plan = GroupPlan(group.index, tuple(group.hf_names), specs, regions, tuple(itemsizes), ops)
    program_of(plan)  # the native check (bounds, overlaps): PlanRefused, a ValueError
    return plan


def load_plans(path: str, digest: str, replica: "ModelReplica") -> tuple[dict[int, GroupPlan], dict[int, str]]:
    """The file's plans (not yet verified: the caller checks each on first use) and refusals;
    nothing when the file is missing, damaged, of another format or another replica."""
    import torch

    try:
        with open(path) as f:
            body = json.load(f)
        if body.get("format") != PLAN_FORMAT or body.get("replica") != digest:
            return {}, {}
        stored, refused_in = dict(body["plans"]), dict(body["refused"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}, {}
    groups = replica.groups
    plans: dict[int, GroupPlan] = {}
    for key, entry in stored.items():
        try:
            group = groups[int(key)]
            if group.index != int(key):
                continue
            sizes = [getattr(torch, replica.param_specs[r.param_name].dtype).itemsize for r in group.regions]
            plans[group.index] = _plan_of(group, sizes, entry)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            continue  # a damaged or foreign entry: that group records again
    refused = {int(k): str(v) for k, v in refused_in.items()
               if str(k).isdigit() and int(k) < len(groups) and int(k) not in plans}
    return plans, refused


class ReplicaPlans:
    """The copy plans of one replica: group index -> verified plan, or the reason it has none."""

    def __init__(self) -> None:
        self.plans: dict[int, GroupPlan] = {}
        self.refused: dict[int, str] = {}  # group index -> why it stays on the loader path
        self.unverified: dict[int, GroupPlan] = {}  # read from disk, not yet checked against the loaders
        self.lock = threading.Lock()  # guards the dicts above
        self.loaders = threading.Lock()  # held while the replica's loaders run (update or recorder)
        self.path: str | None = None  # the disk file, if the replica has a cache
        self.digest = ""
        self.loaded = 0  # plans read from disk
        self.dropped = 0  # plans read from disk whose first replay differed from the loaders
        self.background = 0  # plans recorded by the background recorder (background_recorder.py)

    def known(self, index: int) -> bool:
        return index in self.plans or index in self.refused

    def save(self) -> None:
        """Write the verified and the still unverified plans to disk (if the replica has a cache)."""
        if self.path:
            with self.lock:
                plans, refused = {**self.unverified, **self.plans}, dict(self.refused)
            try:
                save_plans(self.path, self.digest, plans, refused)
            except OSError as e:  # the cache only saves time
                logger.warning("could not save copy plans to %s: %s", self.path, e)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.plans.values())


_PLANS: "weakref.WeakKeyDictionary[Any, ReplicaPlans]" = weakref.WeakKeyDictionary()
_PLANS_LOCK = threading.Lock()


def plans_of(replica: Any) -> ReplicaPlans:
    """The process's plans of one replica (created empty; dropped with the replica): plans belong to
    the replica as its loader mapping does (one replica per shard layout per process)."""
    with _PLANS_LOCK:
        plans = _PLANS.get(replica)
        if plans is None:
            plans = _PLANS[replica] = ReplicaPlans()
            plans.path = plan_path(replica)
            if plans.path:
                plans.digest = replica.key.digest()
                plans.unverified, plans.refused = load_plans(plans.path, plans.digest, replica)
                plans.loaded = len(plans.unverified)
        return plans


def background_recorded(replicas: Sequence[Any]) -> int:
    """Plans of these replicas (each once) that the background recorder recorded."""
    seen: dict[int, Any] = {id(r): r for r in replicas}
    return sum(plans_of(r).background for r in seen.values())


def plan_memory(replicas: Sequence[Any]) -> int:
    """Bytes the recorded plans of these replicas hold (each replica once)."""
    seen: dict[int, Any] = {id(r): r for r in replicas}
    return sum(plans_of(r).nbytes for r in seen.values())
