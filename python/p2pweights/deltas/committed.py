"""The identity of what an engine holds, as deltas need it: proven, never assumed.

A delta is only right against the bytes it was computed from. An engine draws a fresh secret
token each time an update commits (end_weight_update succeeded) and answers it, with its epoch, to
the owner that committed it; it forgets the token the moment any session begins (the weights may
change from then on). A sender's delta names the (epoch, token) it was computed against in its
begin call; the engine accepts it only when both are the ones it holds. So any other writer in
between (another controller, the broadcast path, a torn or given-up session, a takeover, which
also moves the epoch, or a restart) makes the claim fail, and the sender writes that engine in full
in the same update (docs/deltas.md). One object per engine, kept by whichever host runs the
engine's control plane: our receiver's leader, the sglang plugin, the vLLM backend.
"""
from __future__ import annotations

import hmac
import secrets
import threading
from typing import Any

#: the begin body's and answer's key, the end body's (manifests) and the end answer's (the new base)
DELTA_KEY = "p2pw_delta"
BASE_KEY = "p2pw_base"


class CommittedBase:
    """One engine's committed identity (thread-safe)."""

    def __init__(self, engine: str = "engine"):
        self.engine = engine
        self._lock = threading.Lock()
        self._token: str | None = None
        self._epoch = 0
        self._why = "no update has committed on this engine since it started"
        self.accepted = False  # the open session's deltas were accepted at its begin

    def open(self, claim: Any, epoch: int, unsupported: str = "") -> dict:
        """A session begins (``claim``: the begin body's ``p2pw_delta``, or None): decide whether its
        deltas are accepted, then forget the token. Answers ``{"accepted": bool, "reason": str}``."""
        with self._lock:
            token, held_epoch, why = self._token, self._epoch, self._why
            self._token, self._why = None, "a session began after the last commit and has not committed"
            self.accepted = False
            if claim is None:
                return {"accepted": False, "reason": "the sender asked for none"}
            if unsupported:
                return {"accepted": False, "reason": unsupported}
            if not isinstance(claim, dict) or not isinstance(claim.get("token"), str) or not isinstance(
                    claim.get("epoch"), int):
                return {"accepted": False, "reason": "the claim is not {epoch: int, token: str}"}
            if token is None:
                return {"accepted": False, "reason": why}
            if claim["epoch"] != epoch or held_epoch != epoch:
                return {"accepted": False, "reason": f"the engine's epoch is {epoch}, the base was committed at "
                                                     f"epoch {claim['epoch']}"}
            if not hmac.compare_digest(claim["token"].encode(), token.encode()):
                return {"accepted": False, "reason": "another update committed on this engine after the sender's "
                                                     "base (another controller, or the broadcast path)"}
            self.accepted = True
            return {"accepted": True, "reason": ""}

    def commit(self, epoch: int) -> dict:
        """The session's end succeeded: a new token for what the engine now holds."""
        with self._lock:
            self._token, self._epoch, self.accepted = secrets.token_hex(16), int(epoch), False
            return {"epoch": self._epoch, "token": self._token}

    def forget(self, why: str) -> None:
        """The weights changed outside a committed update (an end that failed, a torn session)."""
        with self._lock:
            self._token, self._why, self.accepted = None, why, False
