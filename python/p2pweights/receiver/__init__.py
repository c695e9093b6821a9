"""The engine side for any PyTorch engine: serve sglang's control endpoints (``ReceiverServer``).

Registering parameters with a transport and publishing them live in ``p2pweights.transport``.
"""
from __future__ import annotations

from .server import ReceiverHooks, ReceiverServer, register_transfer_engine_info

__all__ = ["ReceiverHooks", "ReceiverServer", "register_transfer_engine_info"]
