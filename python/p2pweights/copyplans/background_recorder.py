"""Recording copy plans in the background, off the update's critical path (``P2PW_COPY_PLANS=background``).

Recording a group's plan runs its loaders on index-encoded inputs (record.py): it needs
the HF inputs' shapes and dtypes, never their values. So right after ``WeightSender.connect`` a
daemon thread walks the prepared ranks' groups and records each from the replica's HF specs — the
engine checkpoint's shapes and dtypes, which is what the stager admits and, for an FP8 engine,
what QuantizeOnSend produces — into scratch memory on the slots' device. Each plan is kept
*unverified*, exactly like a plan read from ``P2PW_REPLICA_CACHE_DIR``: the group's next load runs
the loaders and keeps the plan only if its replay equals their bytes (sender/slot_producer.py).

Sharing the replica: its loaders re-point the replica's parameters, so the recorder holds the
replica's :attr:`~p2pweights.copyplans.store.ReplicaPlans.loaders` lock, but only around each run
of the loaders (one or two per group): encoding and decoding ids, most of a recording (the 155 MB
embedding of a Qwen3-0.6B TP2 rank: ~1 s, its loader runs ~0.07 s), need no lock. Before every step
(a pass's encoding, a loader run, a chunk's decoding) and between groups it waits while an update
of its sender is in flight: at the lowest CPU priority on a busy host, a recorder holding the lock
through a whole group made the first update wait for it (0.5 s of a 1.2 s first update, where
steady ones took 0.65 s). So an update waits for at most one loader run that began before it.
The thread records one group at a time (memory: one group's scratch, kept while it waits), stops
on ``close()`` or a reconnect (within a step), and logs its first error once: a group it could not
record stays on the loader path.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Sequence

from .group_plan import NotACopy
from .record import record_group_plan
from .store import plans_of

logger = logging.getLogger("p2pweights.copyplans")

PAUSE_SECONDS = 0.002  # between groups: the trainer's threads get the GIL and the cores
BUSY_POLL_SECONDS = 0.05  # while an update is in flight


class _GiveUp(Exception):
    """Raised between a recording's steps: the recorder stopped, or an update settled the group."""


def _lowest_priority() -> None:
    """Nice this thread (Linux: a thread id is a process id to setpriority); best effort."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def spec_inputs(replica: Any, group: Any) -> dict[str, Any]:
    """Shape-and-dtype stand-ins (meta tensors) of the group's HF inputs as the sender feeds them."""
    import torch

    specs = replica.hf_specs
    return {n: torch.empty(tuple(specs[n].shape), dtype=getattr(torch, specs[n].dtype), device="meta")
            for n in group.hf_names}


class PlanRecorder:
    """Records the plans of ``ranks``' groups in a daemon thread (see the module).

    ``busy()``: True while an update is in flight (the recorder waits). ``recorded``: plans recorded;
    ``refused``: groups whose loaders compute; ``failed``: groups that raised; ``error``: the first
    failure. ``before_group(replica, group)``: called before each group (tests pause it there).
    ``record(replica, group, like, device=, loaders_lock=, between_steps=)``: record.py's function.
    """

    def __init__(self, ranks: Sequence[Any], device: Any, busy: Callable[[], bool] = lambda: False,
                 record: Callable[..., Any] = record_group_plan):
        self._ranks = list(ranks)
        self._device = device
        self._busy = busy
        self._record = record
        self._stop = threading.Event()
        self.finished = threading.Event()
        self.recorded = self.refused = self.failed = 0
        self.error: str | None = None
        self.before_group: Callable[[Any, Any], None] | None = None
        self._thread = threading.Thread(target=self._run, name="p2pw-plan-recorder", daemon=True)

    def start(self) -> "PlanRecorder":
        self._thread.start()
        return self

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every group was visited (or the recorder stopped); False on timeout."""
        return self.finished.wait(timeout)

    def stop(self, timeout: float | None = 60.0) -> None:
        """Stop at the next step of the group being recorded (if any) and join the thread."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _run(self) -> None:
        _lowest_priority()
        try:
            seen: set[int] = set()
            for p in self._ranks:
                replica = p.replica
                if id(replica) in seen:
                    continue
                seen.add(id(replica))
                plans = plans_of(replica)
                before = self.recorded
                for group in replica.groups:
                    if not self._pause():
                        return
                    if self.before_group is not None:
                        self.before_group(replica, group)
                    if self._stop.is_set():
                        return
                    self._record_one(replica, plans, group)
                if self.recorded != before:
                    plans.save()
        finally:
            self.finished.set()

    def _pause(self) -> bool:
        """Yield between groups; wait while an update runs. False once stopped."""
        if self._stop.wait(PAUSE_SECONDS):
            return False
        return self._wait_while_updating()

    def _wait_while_updating(self) -> bool:
        """Return once no update is in flight: True, or False once stopped."""
        while self._busy():
            if self._stop.wait(BUSY_POLL_SECONDS):
                return False
        return not self._stop.is_set()

    def _record_one(self, replica: Any, plans: Any, group: Any) -> None:
        def settled() -> bool:
            with plans.lock:
                return plans.known(group.index) or group.index in plans.unverified

        def between_steps() -> None:
            if not self._wait_while_updating():
                raise _GiveUp("stopped")
            if settled():  # an update recorded or checked it meanwhile (copy_plans="on")
                raise _GiveUp("settled")

        if settled():
            return
        try:
            like = spec_inputs(replica, group)
            plan = self._record(replica, group, like, device=self._device, loaders_lock=plans.loaders,
                                between_steps=between_steps)
        except _GiveUp:
            return
        except NotACopy as e:
            with plans.lock:
                plans.refused[group.index] = str(e)
            self.refused += 1
            logger.info("group %d (%s) stays on the loader path: %s", group.index, group.params[0], e)
            return
        except Exception as e:  # noqa: BLE001 - recording only saves time: the loaders' path stands
            self.failed += 1
            if self.error is None:
                self.error = f"{type(e).__name__}: {e}"
                logger.warning("background copy-plan recording failed for group %d (%s): %s; such groups stay "
                               "on the loader path", group.index, group.params[0], self.error)
            return
        with plans.lock:
            if not (plans.known(group.index) or group.index in plans.unverified):
                plans.unverified[group.index] = plan
                plans.background += 1
                self.recorded += 1
