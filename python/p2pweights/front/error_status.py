"""Which HTTP status and error payload answer an exception, the same on every host (our receiver
and its ranks, the sglang plugin, the vLLM backend): :func:`answer_for`.

=====================================================  ======  ===========================================
raised                                                 status  message of the payload
=====================================================  ======  ===========================================
``SessionConflict``, ``TornWeights``                   409     the error's own (its class and fields)
``InvalidRequest``, ``UnknownParameter``, ``OutOfOrder`` 400     the error's own (its class and fields)
:class:`StatusError` (a refusal in its host's words)   its own its own, as ``EngineError``
any other ``P2PWeightsError``                          500     ``<route> failed in the engine: <Class>:
                                                               <message>``, its class and fields
anything else                                          500     the same, as ``EngineError``
=====================================================  ======  ===========================================

The payload is always ``control.error_answers.error_payload``'s, so a client raises the class it
names with its fields (engine, rank, parameter, hint).
"""
from __future__ import annotations

from typing import Any

from ..control import error_answers
from ..control import protocol as p
from ..errors import InvalidRequest, OutOfOrder, P2PWeightsError, SessionConflict, TornWeights, UnknownParameter


class StatusError(Exception):
    """A refusal that is its own answer: ``status`` (400 unless said) and the error payload's
    ``fields`` (``hint``, ``rank``, ...). A host raises it for a call refused in its engine's own words
    (sglang's 400 for a call out of order, a bad body, a 413)."""

    status: int = p.BAD_REQUEST

    def __init__(self, message: str, status: int | None = None, **fields: Any):
        super().__init__(message)
        if status is not None:
            self.status = int(status)
        self.fields = fields

    def payload(self) -> dict:
        return error_answers.error_payload(str(self), **self.fields)


def answer_for(error: BaseException, route: str | None = None, **fields: Any) -> tuple[int, dict]:
    """(status, error payload) of ``error`` raised while answering ``route`` (its path). ``fields``
    fill the payload's fields the error leaves out (the rank that answers). ``route=None``: a 500's
    message is the error's alone (``<Class>: <message>`` for one that is no P2PWeightsError): the
    caller names the route itself (a leader prefixes ``rank N:`` to its ranks' answers)."""
    extra = {k: v for k, v in fields.items() if v is not None}
    if isinstance(error, (SessionConflict, TornWeights)):
        return p.CONFLICT, error_answers.error_payload(error, **extra)
    if isinstance(error, (InvalidRequest, UnknownParameter, OutOfOrder)):  # the caller's input (a name the engine does not hold)
        return p.BAD_REQUEST, error_answers.error_payload(error, **extra)
    if isinstance(error, StatusError):
        status = error.status if 400 <= error.status < 600 else p.ENGINE_FAILED
        return status, error_answers.error_payload(str(error), **{**error.fields, **extra})
    typed = isinstance(error, P2PWeightsError)
    what = error.message if typed else str(error)
    if route is None:
        message = what if typed else f"{type(error).__name__}: {what}"
    else:
        message = f"{route} failed in the engine: {type(error).__name__}: {what}"
    own = error.fields() if typed else {}
    return p.ENGINE_FAILED, error_answers.error_payload(message, type_name=type(error).__name__ if typed else None,
                                                        **{**own, **extra})
