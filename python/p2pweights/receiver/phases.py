"""How long each phase of a control call took inside the receiver: the server collects what its
hooks record while it handles one call (:func:`record_phase`) and answers it under
``p2pw_timings`` next to the verb's own answer (sglang's clients ignore the extra key);
benchmarks/profile_control.py reads it."""
from __future__ import annotations

import contextvars
from typing import Any

_phase_times: contextvars.ContextVar[dict | None] = contextvars.ContextVar("p2pw_phase_times", default=None)


def collect(into: dict) -> contextvars.Token:
    """From now on, in this thread, phases are recorded ``into`` (until :func:`stop`)."""
    return _phase_times.set(into)


def stop(token: contextvars.Token) -> None:
    _phase_times.reset(token)


def record_phase(name: str, seconds: Any) -> None:
    """A hook says how long one phase of the call it runs took (``ping_s``, ``end_s``, each rank's
    own seconds); nothing when no call is being handled in this thread."""
    times = _phase_times.get()
    if times is not None:
        times[name] = seconds
