"""The control plane: the protocol (routes, bodies, status codes, error payloads) shared with the
receiver's server, the one HTTP client, the sglang engine client, and update sessions on many engines."""
from __future__ import annotations

from .session import EngineCalls, UpdateSession, call_engines
from .sglang import SglangEngine

__all__ = ["EngineCalls", "SglangEngine", "UpdateSession", "call_engines"]
