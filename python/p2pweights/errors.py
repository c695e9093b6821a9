"""Typed exceptions at the Python edge: one class per meaning, all under P2PWeightsError.

The native core returns status codes (``_native.Code``, csrc/status.h); :data:`CLASS_OF_CODE` names
the class of each error code, and :func:`raise_for_status` raises it. The integers come from the enum
alone: :func:`code_of` is how Python code names one (``code_of("DEVICE_ERROR")``).
"""
from __future__ import annotations

import re
from typing import Mapping

from . import _native

#: the context fields every P2PWeightsError can carry (keyword arguments, default None)
FIELDS = ("engine", "rank", "parameter", "hint")


class P2PWeightsError(Exception):
    """Base class of every error p2pweights raises.

    Besides its message, every error can say where it happened and what to do, as fields a caller
    can read (``except UpdateFailed as e: e.engine, e.rank``): ``engine`` (the engine's name),
    ``rank`` (the engine rank), ``parameter`` (a parameter or HF tensor name) and ``hint`` (the
    fix). ``str()`` is the message followed by whichever fields it does not already mention.
    """

    #: the native status code this class stands for (set from ``_native.Code`` below; TRANSPORT_ERROR
    #: for the classes no code maps to, e.g. when a Python transport raises one)
    p2pw_code: int

    def __init__(self, *args: object, engine: str | None = None, rank: int | None = None,
                 parameter: str | None = None, hint: str | None = None):
        super().__init__(*args)
        self.engine = engine
        self.rank = rank
        self.parameter = parameter
        self.hint = hint

    def fields(self) -> dict[str, object]:
        """The context fields that are set (engine, rank, parameter, hint)."""
        return {k: getattr(self, k, None) for k in FIELDS if getattr(self, k, None) is not None}

    @property
    def message(self) -> str:
        """The message alone, without the fields."""
        return str(self.args[0]) if len(self.args) == 1 else (", ".join(map(str, self.args)) if self.args else "")

    def __str__(self) -> str:
        msg = self.message
        # a field the message already names is not repeated: messages written before the fields
        # existed ("engine e0 (http://...): ...") read the same as they always did
        where = [f"{k} {v}" for k in ("engine", "rank", "parameter") if (v := getattr(self, k, None)) is not None
                 and not re.search(rf"\b{k} {re.escape(str(v))}(?![\w.])", msg)]
        if where:
            msg = f"{msg} ({', '.join(where)})" if msg else ", ".join(where)
        hint = getattr(self, "hint", None)
        if hint and f"Hint: {hint}" not in msg:
            msg = f"{msg}. Hint: {hint}"
        return msg

    def __reduce__(self):  # keep the fields across pickling (errors cross process boundaries)
        return _rebuild, (type(self), self.args, dict(self.__dict__))


def _rebuild(cls: type, args: tuple, state: dict) -> P2PWeightsError:
    err = cls.__new__(cls, *args)
    err.args = args
    err.__dict__.update(state)
    return err


class InvalidWrite(P2PWeightsError, ValueError):
    """A write or request was refused before anything was posted (bad offset, size, engine...)."""


class TransferTimeout(P2PWeightsError, TimeoutError):
    """A write was still running past the transfer timeout; it was cancelled."""


class RemoteDisconnected(P2PWeightsError, ConnectionError):
    """The peer (an engine rank) went away."""


class TransportError(P2PWeightsError):
    """The transport (Mooncake, NIXL, loopback) reported a failure."""


class Closed(P2PWeightsError):
    """The object was already closed."""


class NotFound(P2PWeightsError, KeyError):
    """An unknown engine, slot or request."""

    __str__ = P2PWeightsError.__str__  # KeyError quotes its message; keep it readable


class Busy(P2PWeightsError):
    """Refused because something is still in flight."""


class OutOfRegion(InvalidWrite):
    """A write lies outside every region the engine published (or a copy outside its slot, or two
    copies of a copy program writing the same bytes)."""


class DeviceError(P2PWeightsError):
    """A CUDA driver or runtime call failed: a copy program's driver copies or kernel launch, or the
    CUDA host registration asked for by name (``pin="cuda"``). Not a transport failure."""


class Fenced(P2PWeightsError):
    """A write was not posted: the session's lease no longer covered it (the sender was stopped or cut
    off longer than its lease; the engine may belong to another controller now). Nothing of it landed."""


class LayoutMismatch(P2PWeightsError):
    """Sender and engine disagree on a parameter's shape, dtype or byte count."""


class UnsupportedLayout(P2PWeightsError):
    """The engine's layout cannot be reproduced by a replica (EPLB, redundant experts, ...)."""


class UnknownParameter(P2PWeightsError, KeyError):
    """An HF tensor name that no parameter of the target layout loads."""

    __str__ = P2PWeightsError.__str__


class UnknownModel(P2PWeightsError, ValueError):
    """A model that is neither a built-in name nor a config.json (or a folder holding one)."""


class PlanError(P2PWeightsError, ValueError):
    """A plan request that cannot describe a real cluster (zero GPUs, TP not dividing heads, ...).

    The message names the flag to change and how.
    """


class LayoutSpecError(UnsupportedLayout, ValueError):
    """A layout no engine can have (ep not dividing tp, ...), or an ``--engine`` spec that cannot be
    read or names a key the command cannot honour."""


class MissingTensors(P2PWeightsError):
    """finish() was called while HF tensors of some parameter groups were still missing."""


class WrongTransport(P2PWeightsError):
    """The engine published its weights for another transport than the sender's."""


class InvalidRequest(P2PWeightsError, ValueError):
    """A control-plane request the protocol refuses: a missing or mistyped field, an unknown mode
    or selector (p2pweights.control.protocol checks bodies on both sides)."""


class EngineError(P2PWeightsError):
    """An engine's control plane (HTTP) failed or answered with an error."""


class OutOfOrder(EngineError):
    """A call out of the engine's order (a begin before the pause, a version or continue inside an
    open session, an end with no session): refused before it runs (400, as sglang answers)."""


class Unauthorized(EngineError, PermissionError):
    """The engine refused the call: it requires an API key (sglang's --api-key) and got none or
    another one (HTTP 401/403)."""


class EngineUnreachable(EngineError, ConnectionError):
    """An engine's control plane could not be reached: refused, no connection within the connect
    timeout, no answer within the read timeout, or the connection was lost mid-call."""


class UpdateFailed(P2PWeightsError):
    """An update failed on one or more engines.

    ``failures`` maps each failed target to why (text): an engine's name, or ``<engine>/rank<N>``
    for the writes into one engine rank. ``errors`` maps a target to its exception where there was
    one. ``engine`` and ``rank`` name the first failure, ``report`` is the writer's report (if any).
    """

    def __init__(self, failures: Mapping[str, str | BaseException], report: object | None = None, *,
                 what: str = "weight update"):
        self.errors = {n: e for n, e in failures.items() if isinstance(e, BaseException)}
        self.failures = {n: str(e) for n, e in failures.items()}
        self.report = report
        lines = [f"{what} failed on {len(self.failures)} engine(s):"]
        lines += [f"  {name}: {why}" for name, why in self.failures.items()]
        first = next(iter(self.failures), None)
        engine, rank = split_target(first) if first is not None else (None, None)
        cause = self.errors.get(first) if first is not None else None
        parameter = hint = None
        if isinstance(cause, P2PWeightsError):
            rank = cause.rank if cause.rank is not None else rank
            parameter, hint = cause.parameter, cause.hint
        super().__init__("\n".join(lines), engine=engine, rank=rank, parameter=parameter, hint=hint)

    def __str__(self) -> str:  # each line already names its target (and its own hint)
        return self.message


class EnginesFailed(UpdateFailed, EngineError):
    """A control-plane verb failed on one or more engines (opening or finishing an update, or any
    verb run on many engines at once): an UpdateFailed that is also an EngineError."""


def split_target(target: str) -> tuple[str, int | None]:
    """(engine, rank) of a write target's name: ``"e0/rank1"`` -> ("e0", 1); ``"e0"`` -> ("e0", None)."""
    m = re.fullmatch(r"(.+)/rank(\d+)", target)
    return (m.group(1), int(m.group(2))) if m else (target, None)


#: every error code of ``_native.Code`` (by name) -> the class raised for it; OK and IN_PROGRESS are
#: not errors (tests/test_status_codes.py pins that each error code has one)
CLASS_OF_CODE: dict[str, type[P2PWeightsError]] = {
    "INVALID_ARGUMENT": InvalidWrite,
    "TIMEOUT": TransferTimeout,
    "REMOTE_DISCONNECTED": RemoteDisconnected,
    "TRANSPORT_ERROR": TransportError,
    "CLOSED": Closed,
    "NOT_FOUND": NotFound,
    "BUSY": Busy,
    "OUT_OF_REGION": OutOfRegion,
    "DEVICE_ERROR": DeviceError,
    "FENCED": Fenced,
}


def code_of(name: str) -> int:
    """The integer of a native status code by its name in ``_native.Code`` (``"DEVICE_ERROR"`` -> -9)."""
    return int(_native.Code.__members__[name])


P2PWeightsError.p2pw_code = code_of("TRANSPORT_ERROR")
for _name, _cls in CLASS_OF_CODE.items():
    _cls.p2pw_code = code_of(_name)
_BY_CODE = {code_of(name): cls for name, cls in CLASS_OF_CODE.items()}


def error_class(code: int) -> type[P2PWeightsError]:
    """The class raised for a native status code; P2PWeightsError for a code this module does not know."""
    return _BY_CODE.get(int(code), P2PWeightsError)


def error_named(name: str) -> type[P2PWeightsError]:
    """The class a control-plane error payload names (its ``type``); EngineError for a name this
    version does not know, or for a class that is not built from a message (UpdateFailed)."""
    cls = globals().get(name)
    if isinstance(cls, type) and issubclass(cls, P2PWeightsError) and not issubclass(cls, UpdateFailed):
        return cls
    return EngineError


def raise_for_status(code: int, message: str) -> None:
    """Called by the native module for every non-OK status."""
    raise error_class(code)(message or f"status {code}")


class NonFiniteTensor(P2PWeightsError, ValueError):
    """A pushed tensor holds NaN or Inf and ``check_finite`` (``P2PW_CHECK_FINITE``) is on; nothing of
    its parameter group was written."""


class UnsupportedTensor(P2PWeightsError, TypeError):
    """A pushed tensor the sender cannot take: e.g. a DTensor that could not be gathered."""


class VersionRefused(P2PWeightsError, ValueError):
    """A weight version that is empty or does not come after the sender's last one or an engine's
    current one (pass ``force=True`` to set it anyway)."""


class SenderGroupError(P2PWeightsError, ValueError):
    """Several senders of one trainer without the group that coordinates them (pass ``group=``), or
    senders of one group that disagree (version, control)."""


class SessionConflict(EngineError):
    """An engine's weight-update session belongs to another controller (its owner): this call was
    refused before it changed anything. The message names the engine, the owner and how old its
    session is; wait for the owner to finish, or for its lease (``P2PW_SESSION_LEASE``) to expire."""


class TornWeights(EngineError):
    """The engine's weights are torn: an update session expired (its owner stopped renewing it) or
    was given up after its writes began. The engine stays paused and refuses to generate until a
    complete update (begin -> every write -> end -> version -> continue) heals it."""


class UpdateRefused(EnginesFailed, SessionConflict):
    """Opening an update was refused, before anything was written, because one or more engines'
    sessions belong to another controller: an ``EnginesFailed`` (``.failures``, ``.errors`` per
    engine) that is also a ``SessionConflict``."""


class EngineMismatch(UnsupportedLayout):
    """The engine's build is not one the sender's replica reproduces: another sglang version, or a
    GPU architecture whose post-processing rewrites the layout (FP8 off Hopper). The message names
    both sides; refused at connect."""


class RevocationFailed(EngineError):
    """A takeover could not revoke the lost owner's epoch on an engine rank: the old endpoint's regions
    could not be unregistered or its connections cut within ``P2PW_REVOKE_TIMEOUT`` (a write of the old
    owner might still land). The begin fails and the engine stays torn; the rank still publishes the
    old epoch, and the next takeover tries again (docs/security.md, "Epochs")."""
