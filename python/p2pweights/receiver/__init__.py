"""The engine side for any PyTorch engine, split by job.

``ReceiverServer`` (``receiver.server``; one request's handling: ``receiver.request_handler``)
serves sglang's control endpoints for any engine given ``ReceiverHooks`` (``receiver.hooks``).
The rest is an engine made of real sglang model ranks, one process each: ``receiver.region`` (a
rank's parameters in one registered allocation), ``receiver.rank`` (``EngineRank``),
``receiver.rank_server`` and ``receiver.hooks``'s ``LeaderHooks`` (the leader and its ranks),
``receiver.rank_process`` and ``receiver.launcher`` (starting rank processes), ``receiver.local``
(``start_engine``, ``LocalEngine``, ``check_weights_equal``: every rank compares its bytes with
sglang's own loader, ``p2pweights.replica.reference``). Registering memory with a transport and
publishing it live in ``p2pweights.transport``. The broadcast baseline plugs in through
``receiver.rank.BroadcastReceiver``: ``receiver.rank_process`` hands the rank the baseline's.
"""
from __future__ import annotations

from typing import Any

from .hooks import ReceiverHooks
from .registration import register_transfer_engine_info
from .server import ReceiverServer

__all__ = ["BroadcastReceiver", "EngineRank", "LeaderHooks", "LocalEngine", "ReceiverHooks", "ReceiverServer",
           "check_weights_equal", "register_transfer_engine_info", "start_engine", "start_engines",
           "start_together"]

# name -> the module defining it; imported on first use (they import torch lazily; keep this package light)
_LAZY = {
    "LocalEngine": ".local", "check_weights_equal": ".local", "start_engine": ".local", "start_engines": ".local",
    "start_together": ".local",
    "EngineRank": ".rank", "BroadcastReceiver": ".rank", "LeaderHooks": ".hooks",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
