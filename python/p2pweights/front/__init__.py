"""The HTTP front: what stands between the network and an engine's verbs, the same on every host
(our receiver and its ranks' endpoint; the sglang plugin and the vLLM backend, whose servers are
Starlette apps on uvicorn too). Host-neutral: nothing here imports sglang or vLLM.

- :mod:`.guard`: the ASGI middleware (:class:`Guard`): the key, body limits (413), the body's
  deadline (408), and every unexpected error answered as JSON.
- :mod:`.error_status`: which status and error payload answer an exception (:func:`answer_for`).
- :mod:`.workers`: where blocking verbs run (worker threads; keyed requests on their own).
- :mod:`.background_server`: an app served by uvicorn on a background thread
  (:class:`BackgroundServer`), with a deadline for each request's head.
- :mod:`.asgi`: the small ASGI steps the hosts' gates share (read a body, replay it, respond).

docs/security.md says what the front defends against, and what it leaves to the network.
"""
from __future__ import annotations

from .background_server import BackgroundServer
from .error_status import StatusError, answer_for
from .guard import KEYED, Guard
from .workers import Workers

__all__ = ["KEYED", "BackgroundServer", "Guard", "StatusError", "Workers", "answer_for"]
