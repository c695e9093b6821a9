"""The one editor of the requests sglang sends to its engine-info bootstrap server (docs/sglang.md,
"Hooks"): a single AROUND hook on ``requests.Session.request``, in the launcher and the schedulers.

sglang calls that server with ``requests`` and gives the plugin no other place to add to a call.
Three modules add to it, each only inside a scope of its own, a ContextVar it sets itself:

- ``bootstrap_key.py``: ``Authorization: Bearer <key>`` on a request to a bootstrap route's path
  (:func:`add_headers`), inside its ``_Carry`` scope;
- ``rank_deltas.py`` and ``rank_epochs.py``: ``delta_area`` and ``epoch`` in the JSON of the rank's
  registration PUT (:func:`add_registration_fields`), while that rank's
  ``_register_to_engine_info_bootstrap`` runs.

A module contributes ``(scope, edit)``: while ``scope`` holds a value, ``edit(value)`` gives what
to add. ``edit`` is called only for a request it applies to, so it may record that it was used.
Every other request, and every request while no scope holds a value, goes through unchanged.
"""
from __future__ import annotations

import contextvars
import inspect
from typing import Any, Callable, Mapping
from urllib.parse import urlsplit

from ..control import routes

TARGET = "requests.sessions.Session.request"
REGISTER_PATH = routes.route("register_transfer_engine_info").path

Edit = tuple[contextvars.ContextVar, Callable[[Any], Mapping[str, Any]]]

# What each module adds, in the order the modules were imported (the JSON keeps that order).
_HEADERS: list[Edit] = []
_FIELDS: list[Edit] = []
_SIGNATURES: dict[Any, inspect.Signature] = {}
_REGISTERED = False  # sglang's HookRegistry would wrap the target once per registration


def add_headers(scope: contextvars.ContextVar, headers: Callable[[Any], Mapping[str, str]]) -> None:
    """While ``scope`` holds a value, a request to a bootstrap route's path gets ``headers(value)``."""
    _HEADERS.append((scope, headers))


def add_registration_fields(scope: contextvars.ContextVar, fields: Callable[[Any], Mapping[str, Any]]) -> None:
    """While ``scope`` holds a value, the registration's request (JSON object body) gets ``fields(value)``."""
    _FIELDS.append((scope, fields))


def _active(edits: list[Edit]) -> list[tuple[Callable[[Any], Mapping[str, Any]], Any]]:
    return [(edit, value) for scope, edit in edits if (value := scope.get()) is not None]


def around_session_request(original: Callable[..., Any], session: Any, *args: Any, **kwargs: Any) -> Any:
    """The AROUND hook on ``requests.Session.request``: the contributed headers on a bootstrap route's
    path, the contributed fields in the registration's JSON; every other request is untouched."""
    headers, fields = _active(_HEADERS), _active(_FIELDS)
    if not headers and not fields:
        return original(session, *args, **kwargs)
    signature = _SIGNATURES.get(original) or _SIGNATURES.setdefault(original, inspect.signature(original))
    bound = signature.bind(session, *args, **kwargs)  # url, headers and json may come positional
    path = urlsplit(str(bound.arguments.get("url", ""))).path
    body = bound.arguments.get("json")
    headers = headers if path in routes.BOOTSTRAP_PATHS else []
    fields = fields if path == REGISTER_PATH and isinstance(body, dict) else []
    if not headers and not fields:
        return original(session, *args, **kwargs)
    if headers:
        added = {k: v for edit, value in headers for k, v in edit(value).items()}
        bound.arguments["headers"] = {**dict(bound.arguments.get("headers") or {}), **added}
    if fields:
        bound.arguments["json"] = {**body, **{k: v for edit, value in fields for k, v in edit(value).items()}}
    return original(*bound.args, **bound.kwargs)


def register() -> None:
    """Install the hook, once in this process however many modules ask for it: sglang's registry is
    asked whether it holds it already (its ``_hooks``), else this module remembers."""
    global _REGISTERED
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    hooks = getattr(HookRegistry, "_hooks", None)
    held = ([h for _, h, *_ in hooks.get(TARGET, ())] if isinstance(hooks, dict) else
            [around_session_request] if _REGISTERED else [])
    if around_session_request in held:
        return
    HookRegistry.register(TARGET, around_session_request, HookType.AROUND)
    _REGISTERED = True
