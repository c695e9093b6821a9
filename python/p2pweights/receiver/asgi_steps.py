"""Moved to :mod:`p2pweights.front.asgi` (the HTTP front's ASGI steps); this name is kept for the
modules that still import it from here."""
from __future__ import annotations

from ..front.asgi import (  # noqa: F401 - re-exported
    CLIENT_LEFT,
    CLOSE_HEADERS,
    JSON_HEADERS,
    Headers,
    answer_of,
    client_host,
    client_left,
    decode,
    encode,
    header,
    read_body,
    replay,
    respond,
    respond_json,
    route_path,
)
