"""Rollout-engine rank assignment (the seed's rule, in one function) and the cost model."""
from __future__ import annotations

from .assign import Engine, Plan, SenderTargets, TrainerLayout, assign_engine_ranks, layout_label, make_plan

__all__ = ["Engine", "Plan", "SenderTargets", "TrainerLayout", "assign_engine_ranks", "layout_label", "make_plan"]
