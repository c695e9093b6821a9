"""Typed exceptions at the Python edge: one class per meaning, all under P2PWeightsError.

The native core returns status codes; :func:`raise_for_status` maps each code to its class.
"""
from __future__ import annotations

from typing import Iterable, Mapping


class P2PWeightsError(Exception):
    """Base class of every error p2pweights raises."""

    p2pw_code = -4


class InvalidWrite(P2PWeightsError, ValueError):
    """A write or request was refused before anything was posted (bad offset, size, engine...)."""

    p2pw_code = -1


class TransferTimeout(P2PWeightsError, TimeoutError):
    """A write was still running past the transfer timeout; it was cancelled."""

    p2pw_code = -2


class RemoteDisconnected(P2PWeightsError, ConnectionError):
    """The peer (an engine rank) went away."""

    p2pw_code = -3


class TransportError(P2PWeightsError):
    """The transport (Mooncake, NIXL, loopback) reported a failure."""

    p2pw_code = -4


class Closed(P2PWeightsError):
    """The object was already closed."""

    p2pw_code = -5


class NotFound(P2PWeightsError, KeyError):
    """An unknown engine, slot or request."""

    p2pw_code = -6

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class Busy(P2PWeightsError):
    """Refused because something is still in flight."""

    p2pw_code = -7


class OutOfRegion(InvalidWrite):
    """A write lies outside every region the engine published."""

    p2pw_code = -8


class LayoutMismatch(P2PWeightsError):
    """Sender and engine disagree on a parameter's shape, dtype or byte count."""


class UnsupportedLayout(P2PWeightsError):
    """The engine's layout cannot be reproduced by a replica (EPLB, redundant experts, ...)."""


class UnknownParameter(P2PWeightsError, KeyError):
    """An HF tensor name that no parameter of the target layout loads."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class MissingTensors(P2PWeightsError):
    """finish() was called while HF tensors of some parameter groups were still missing."""


class WrongTransport(P2PWeightsError):
    """The engine published its weights for another transport than the sender's."""


class EngineError(P2PWeightsError):
    """An engine's control plane (HTTP) failed or answered with an error."""


class UpdateFailed(P2PWeightsError):
    """An update failed on one or more engines; ``failures`` maps engine name -> reason."""

    def __init__(self, failures: Mapping[str, str], report: object | None = None):
        self.failures = dict(failures)
        self.report = report
        lines = [f"weight update failed on {len(self.failures)} engine(s):"]
        lines += [f"  {name}: {why}" for name, why in self.failures.items()]
        super().__init__("\n".join(lines))


_BY_CODE = {
    cls.p2pw_code: cls
    for cls in (InvalidWrite, TransferTimeout, RemoteDisconnected, TransportError, Closed, NotFound, Busy, OutOfRegion)
}


def error_class(code: int) -> type[P2PWeightsError]:
    return _BY_CODE.get(int(code), P2PWeightsError)


def raise_for_status(code: int, message: str) -> None:
    """Called by the native module for every non-OK status."""
    raise error_class(code)(message or f"status {code}")


def failures_of(engine_reports: Iterable[Mapping[str, object]]) -> dict[str, str]:
    """engine name -> error text for every failed engine of a native writer report."""
    return {str(r["name"]): str(r["error"]) for r in engine_reports if r["state"] == "failed"}
