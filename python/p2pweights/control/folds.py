"""Verbs an owner sends back to back, folded into one call on the engines that say they may be
(docs/protocol.md, "One update"): a receiver's begin answers ``protocol.END_FOLDS`` (its end may bump
the version and continue too: :func:`end_folded` reads what each did) and ``protocol.BEGIN_PAUSES``
(its next begin may pause first: :data:`PAUSE_IN_BEGIN` remembers it, per engine client). sglang's
servers answer neither, so they never get a folded call.
"""
from __future__ import annotations

import threading
import weakref
from typing import Any

from . import error_answers
from . import protocol as p


class StepFailed(Exception):
    """Which of an engine's end -> version -> continue calls failed (``step``), and why (``error``)."""

    def __init__(self, step: str, error: BaseException):
        super().__init__(f"{step}: {error}")
        self.step, self.error = step, error


def end_folded(engine: Any, answer: Any) -> bool:
    """What an end that was asked to bump and continue too says it did: True when both succeeded;
    a ``StepFailed`` naming the first that failed; False when it did neither (the answer has no
    ``END_THEN``: the separate calls follow)."""
    then = answer.get(p.END_THEN) if isinstance(answer, dict) else None
    if not isinstance(then, dict):
        return False
    for verb in ("update_weight_version", "continue_generation"):
        said = then.get(verb)
        if not (isinstance(said, dict) and said.get("success") is not False):
            error = error_answers.ErrorAnswer.of(said)
            raise StepFailed(verb, error.exception(
                f"engine {engine.name} ({engine.base_url}): {verb} after end_weight_update failed: "
                f"{error.message or 'no answer for it'}", engine=engine.name))
    return True


class PauseInBegin:
    """The engine clients whose last begin answered ``BEGIN_PAUSES``: the next update pauses them in
    its begin (one round trip instead of two). Kept per client object (a server started anew on a
    port another one had is not taken for it), weakly; forgotten when such a begin fails or its
    answer does not say it paused (another server behind the URL now): the next update pauses apart."""

    def __init__(self) -> None:
        self._clients: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._lock = threading.Lock()

    def folds(self, engine: Any) -> bool:
        with self._lock:
            return engine in self._clients

    def learn(self, engine: Any, begin_answer: Any) -> None:
        with self._lock:
            if isinstance(begin_answer, dict) and begin_answer.get(p.BEGIN_PAUSES) is True:
                self._clients.add(engine)
            else:
                self._clients.discard(engine)

    def forget(self, engine: Any) -> None:
        with self._lock:
            self._clients.discard(engine)

    @staticmethod
    def paused(begin_answer: Any) -> bool:
        """Whether a begin that was asked to pause first says it did."""
        said = begin_answer.get(p.PAUSE_FIRST) if isinstance(begin_answer, dict) else None
        return isinstance(said, dict) and said.get("status") == "ok"


#: this process's knowledge of which engines pause in their begin
PAUSE_IN_BEGIN = PauseInBegin()
