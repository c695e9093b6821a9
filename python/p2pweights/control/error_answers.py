"""The control plane's error answers. A receiver answers every error with one payload
(:func:`error_payload`), understood by the client and ignored by anything that reads sglang's
``{"success": false, "message": ...}``::

    {"success": false, "message": "<text>",
     "error": {"type": "<a p2pweights.errors class>", "message": "<text>",
               "engine": str | null, "rank": int | null, "parameter": str | null, "hint": str | null}}

The client reads any error answer with :class:`ErrorAnswer` (ours, or one of sglang's shapes,
which become an ``EngineError``) and raises the class named in ``type`` with those fields;
:func:`hint_for` says what to do about an answer that carried no hint of its own.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .. import errors
from ..errors import EngineError, P2PWeightsError
from .protocol import (
    BAD_REQUEST,
    CONFLICT,
    ENGINE_FAILED,
    FORBIDDEN,
    NO_SESSION,
    NOT_FOUND,
    SEED_FLAG,
    SESSION_ALREADY_OPEN,
    TORN,
    UNAUTHORIZED,
)


def error_payload(error: BaseException | str, *, type_name: str | None = None, **fields: Any) -> dict:
    """The one error answer of a receiver. A P2PWeightsError gives its own class and fields; any
    other exception (or text) is reported as ``type_name`` (default EngineError)."""
    if isinstance(error, P2PWeightsError):
        kind, message = type(error).__name__, error.message
        fields = {**error.fields(), **{k: v for k, v in fields.items() if v is not None}}
    else:
        kind, message = type_name or EngineError.__name__, str(error)
    detail = {"type": kind, "message": message}
    detail.update({k: fields.get(k) for k in errors.FIELDS})
    return {"success": False, "message": message, "error": detail}


@dataclass
class ErrorAnswer:
    """What an error answer says, whichever shape it came in (ours, or one of sglang's)."""

    type: str | None
    message: str
    fields: dict

    @classmethod
    def of(cls, answer: Any) -> "ErrorAnswer":
        if isinstance(answer, dict):
            err = answer.get("error")
            if isinstance(err, dict):  # ours, and sglang's {"error": {"message"}}
                return cls(err.get("type"), str(err.get("message", "")),
                           {k: err[k] for k in errors.FIELDS if err.get(k) is not None})
            for key in ("message", "detail"):  # sglang's {"success", "message"}; FastAPI's {"detail"}
                if isinstance(answer.get(key), str):
                    return cls(None, answer[key], {})
            return cls(None, clip(json.dumps(answer)), {})
        return cls(None, clip("" if answer is None else str(answer)), {})

    def exception(self, message: str, **fields: Any) -> P2PWeightsError:
        """The exception this answer names, with ``message``; ``fields`` fill what the answer left out."""
        cls = errors.error_named(self.type) if self.type else EngineError
        merged = {**{k: v for k, v in fields.items() if v is not None}, **self.fields}
        return cls(message, **merged)


def clip(text: str, limit: int = 500) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def hint_for(verb: str, status: int, message: str) -> str:
    """What to do about an error answer to ``verb`` that carried no hint of its own."""
    if verb in ("remote_instance_transfer_engine_info", "get_transfer_engine_info") and status in (
            BAD_REQUEST, NOT_FOUND):
        return (f"is the engine started with {SEED_FLAG} and done loading? Its ranks publish their "
                f"weights to the engine-info bootstrap server (--engine-info-bootstrap-port, default 6789)")
    if status == NOT_FOUND:
        return ("the engine does not serve this route: p2pweights needs sglang 0.5.23's control endpoints "
                "(or a p2pweights.receiver server)")
    if status in (UNAUTHORIZED, FORBIDDEN):
        return "the engine requires an API key: pass api_key= (its --api-key or --admin-api-key)"
    if status == CONFLICT and TORN in message:
        return "only a complete update (begin, every write, end, version, continue) heals torn weights"
    if status == CONFLICT:
        return ("another controller owns this engine's weight-update session: wait for it to finish, or "
                "for its lease (P2PW_SESSION_LEASE) to expire")
    if verb == "begin_weight_update" and SESSION_ALREADY_OPEN in message:
        return ("a previous update left this engine's weight-update session open (it failed after the "
                "writes began); UpdateSession resumes such a session, or end it by hand")
    if verb == "end_weight_update" and NO_SESSION in message:
        return "call begin_weight_update first"
    if verb == "update_weight_version" and "session" in message:
        return "end the weight update before bumping the version"
    if status >= ENGINE_FAILED:
        return "the engine failed while handling the call; see its log"
    return ""
