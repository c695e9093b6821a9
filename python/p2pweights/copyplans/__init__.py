"""Copy plans: a parameter group's loaders recorded once as byte copies, then replayed without them.

One interface, one module per job:

- record (record.py): :func:`record_group_plan` runs the group's loaders on id-encoded inputs and
  reads back which input element each destination element came from; :func:`differing_parameters`
  is the first replay's byte-for-byte check against the loaders;
- store (store.py): :func:`plans_of` a replica (:class:`ReplicaPlans`: verified, unverified,
  refused), kept with the replica and in ``P2PW_REPLICA_CACHE_DIR``;
- compile (program.py): a plan as a native copy program, checked once by the native core (inside
  the group and its inputs, no two copies writing one byte), joined per slot;
- replay (replay.py): :class:`ReplayOrder`, the fallback order as an object (host: native threads,
  element views; GPU: the batched kernel, driver copies, element views);
- record in the background (background_recorder.py): :class:`PlanRecorder`.

The plan type is group_plan.py; the torch fallback is element_views.py.
"""
from __future__ import annotations

from .background_recorder import PlanRecorder
from .group_plan import GroupPlan, NotACopy
from .program import PlanRefused, program_of
from .record import differing_parameters, record_group_plan
from .replay import DeferredReplay, ReplayOrder, ReplayPath, cuda_copies_available
from .store import ReplicaPlans, background_recorded, plan_memory, plans_of

__all__ = [
    "GroupPlan",
    "NotACopy",
    "PlanRecorder",
    "PlanRefused",
    "DeferredReplay",
    "ReplayOrder",
    "ReplayPath",
    "ReplicaPlans",
    "background_recorded",
    "cuda_copies_available",
    "differing_parameters",
    "plan_memory",
    "plans_of",
    "program_of",
    "record_group_plan",
]
