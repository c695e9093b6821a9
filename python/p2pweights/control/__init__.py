"""Control-plane clients for rollout engines (sglang's HTTP endpoints; p2pweights receivers serve the same)."""
from __future__ import annotations

from .sglang import EngineCalls, SglangEngine, UpdateSession, call_engines

__all__ = ["EngineCalls", "SglangEngine", "UpdateSession", "call_engines"]
