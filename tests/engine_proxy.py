"""Receiver hooks that pose as a real engine: they answer its server and model info, so a
ReceiverServer with them looks like that engine to a sender, while a test decides the rest
(a doctored publication, a missing route)."""
from __future__ import annotations

from p2pweights.control import SglangEngine
from p2pweights.receiver import ReceiverHooks


class PosingAs(ReceiverHooks):
    def __init__(self, real: str):
        self.real = SglangEngine(real)

    def server_info(self) -> dict:
        return self.real.server_info()

    def model_info(self) -> dict:
        return self.real.model_info()
