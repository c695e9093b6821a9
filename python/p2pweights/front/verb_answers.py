"""How an ASGI gate answers one verb it ran (the sglang plugin's and the vLLM backend's gates): the
engine's own bytes where nothing changed them, the changed body as JSON, and any exception as the
front's one error answer (:func:`~.error_status.answer_for`)."""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from . import asgi
from .error_status import answer_for


async def respond_verb(send: Any, path: str, run: Callable[[], Awaitable[Any]]) -> None:
    """Answer ``run()``'s answer (``status``, ``body``, and ``raw``/``headers`` when the engine's own
    bytes pass through unchanged); ``run()`` returning None has answered already."""
    try:
        answer = await run()
    except Exception as e:  # noqa: BLE001 - every failure is an answer (error_status.py)
        status, payload = answer_for(e, path)
        return await asgi.respond_json(send, status, payload)
    if answer is None:
        return None
    if answer.raw is not None:
        return await asgi.respond(send, answer.status, answer.headers or asgi.JSON_HEADERS, answer.raw)
    return await asgi.respond_json(send, answer.status, answer.body)
