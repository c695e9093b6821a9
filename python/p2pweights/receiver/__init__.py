"""The engine side for any PyTorch engine.

``ReceiverServer`` serves sglang's control endpoints; ``start_engine`` runs an engine of T rank
processes holding sglang's model of their rank in one registered region each (``receiver.engine``);
``check_weights_equal`` asks every rank to compare its bytes with sglang's own loader.
Registering memory with a transport and publishing it live in ``p2pweights.transport``.
"""
from __future__ import annotations

from typing import Any

from .server import ReceiverHooks, ReceiverServer, register_transfer_engine_info

__all__ = ["LocalEngine", "ReceiverHooks", "ReceiverServer", "check_weights_equal", "register_transfer_engine_info",
           "start_engine", "start_engines"]


def __getattr__(name: str) -> Any:  # the engine module imports torch lazily; keep this package light
    if name in ("LocalEngine", "check_weights_equal", "start_engine", "start_engines"):
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
