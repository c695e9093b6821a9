"""The control plane: the protocol (routes, bodies, status codes, error payloads) shared with the
receiver's server, the one HTTP client, the sglang and vLLM engine clients, and update sessions on many engines."""
from __future__ import annotations

from .engine_calls import EngineCalls, call_engines
from .sglang import SglangEngine
from .update_session import FailurePolicy, UpdateSession
from .vllm import VllmEngine

__all__ = ["EngineCalls", "FailurePolicy", "SglangEngine", "UpdateSession", "VllmEngine", "call_engines"]
