"""Several senders of one trainer, coordinated through the trainer's torch.distributed group.

Sender 0 of the group controls the engines' session (pause, begin; end, version, continue), every
sender writes, and the version is bumped only after every sender's writes completed. Each update
is a fixed sequence of small all-gathers of :class:`SenderStatus`, which every sender reaches on
success and on failure alike, so a failure anywhere fails every sender instead of hanging one:

    start   at update():          versions and controls agree, each sender's version checks passed
    ready   at the first push:    every sender's first push passed its checks -> sender 0 pauses
    opened                        sender 0's pause + begin answer -> everyone may write
    written at finish (or abort): every sender's writes returned -> sender 0 ends (or not)
    ended                         sender 0's account of the engines -> everyone returns or raises

Without a group (one sender), each gather is that sender's own status.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SenderStatus:
    """One sender's word at one step of an update (picklable: it crosses the group)."""

    sender: int
    failures: dict[str, str] = field(default_factory=dict)  # target (engine/rank, or "sender N") -> why
    written: bool = False  # some of its writes may have landed
    version: str = ""
    control: bool = True
    note: str = ""  # sender 0's account of the engines after the update
    epochs: dict[str, int] = field(default_factory=dict)  # the controller's: each engine's epoch at begin
    instances: dict[str, str] = field(default_factory=dict)  # the controller's: each engine's process at begin
    # delta updates (delta_writes.py): sender 0's claims and answers at opened, every sender's manifests
    # at written, sender 0's new identities at ended
    deltas: dict[str, Any] = field(default_factory=dict)
    # sender 0's session owner (token, label) at opened: the group's senders apply their own delta
    # records beside their writes under it (apply_beside.py); the trainer's own group, never an engine
    owner: tuple[str, str] | None = None

    @property
    def ok(self) -> bool:
        return not self.failures


class SenderGroup:
    """The trainer's process group as the senders use it; ``group=None`` is a group of one."""

    def __init__(self, group: Any = None):
        self.group = group
        if group is None:
            self.index, self.size = 0, 1
        else:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise ValueError("group= needs torch.distributed initialized (init_process_group) first")
            self.index, self.size = dist.get_rank(group), dist.get_world_size(group)
            if self.index < 0:
                raise ValueError("this process is not a member of the group passed as group=")

    @property
    def controller(self) -> bool:
        """Sender 0 drives the engines' session."""
        return self.index == 0

    def gather(self, status: SenderStatus) -> list[SenderStatus]:
        """Every sender's status at this step (a collective: every sender must call it)."""
        if self.size == 1:
            return [status]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, status, group=self.group)
        return out


def others_failures(statuses: list[SenderStatus], me: int) -> dict[str, str]:
    """Every failure of the other senders, each saying which sender saw it."""
    out: dict[str, str] = {}
    for s in statuses:
        if s.sender != me:
            for target, why in s.failures.items():
                out.setdefault(target, f"(sender {s.sender}) {why}")
    return out


def all_failures(statuses: list[SenderStatus]) -> dict[str, str]:
    return others_failures(statuses, -1)
