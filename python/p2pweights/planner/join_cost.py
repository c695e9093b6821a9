"""What a join costs (`p2pweights plan --join N`): N more engines like the last one join the set
(docs/sender.md, "The engine set"). Their first update writes them in full while the kept engines
stay deltas (or full, without ``--changed-fraction``); after it, every update covers the larger set.

The join update is priced as a range: at least the slower of the kept engines' update and the new
engines' full write alone (as if they shared no link), at most the two one after the other (the
same senders' NICs carry both). The join's own
work before that update (each new engine's ``/server_info``, replicas and publications, on a thread
with ``add_engines(wait=False)``) is off the update path and not priced.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..models.shapes import ModelShape, PlanError
from .assign import Engine, TrainerLayout, make_plan
from .cost import Cost, Links, predict


@dataclass(frozen=True)
class JoinCost:
    joining: int
    gpus: int  # of each joining engine
    kept_seconds: float  # the kept engines' update (delta at the first fraction given, else full)
    new_alone_seconds: float  # the joining engines written in full, alone
    after: Cost  # a full update of the larger set

    @property
    def join_seconds_min(self) -> float:
        return max(self.kept_seconds, self.new_alone_seconds)

    @property
    def join_seconds_max(self) -> float:
        return self.kept_seconds + self.new_alone_seconds

    def as_json(self) -> dict:
        return {"joining": self.joining, "gpus": self.gpus, "kept_seconds": self.kept_seconds,
                "new_alone_seconds": self.new_alone_seconds, "join_seconds_min": self.join_seconds_min,
                "join_seconds_max": self.join_seconds_max, "after_full_p2p_seconds": self.after.p2p_seconds,
                "after_floor_seconds": self.after.floor_seconds}


def predict_join(n: int, trainer: TrainerLayout, engines: Sequence[Engine], shape: ModelShape, links: Links,
                 dtype: str, tensors: Sequence[int] | None, kept_seconds: float, *, balanced: bool = False) -> JoinCost:
    """``n`` engines like ``engines[-1]`` join (module docstring)."""
    if n < 1:
        raise PlanError(f"--join: {n} engines; give at least 1")
    new = [engines[-1]] * n
    larger = predict(make_plan(trainer, [*engines, *new], shape, balanced=balanced), shape, links, dtype, tensors)
    alone = predict(make_plan(trainer, new, shape, balanced=balanced), shape, links, dtype, tensors)
    return JoinCost(n, engines[-1].gpus, kept_seconds, alone.p2p_seconds, larger)


def render_join(j: JoinCost) -> str:
    return "\n".join([
        "",
        f"join       {j.joining} engine(s) of {j.gpus} GPUs join: their first update writes them in full, the kept "
        f"engines' update goes on beside it",
        f"  join update       {j.join_seconds_min:.3f} s to {j.join_seconds_max:.3f} s (the kept engines' update "
        f"{j.kept_seconds:.3f} s; the new ones alone, in full, {j.new_alone_seconds:.3f} s)",
        f"  after the join    full update {j.after.p2p_seconds:.3f} s (wire floor {j.after.floor_seconds:.3f} s)",
    ])
