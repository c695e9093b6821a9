"""The sender's NIXL data path: native (NIXL's C API, no GIL) or Python (NIXL's Python API).

``make_nixl_transport`` picks, by P2PW_NIXL_API:
  auto (default)  the native ``_native.NixlTransport`` when the installed NIXL wheel ships a usable
                  ``libnixl_capi.so``; otherwise ``_native.PyTransport`` over ``nixl.NixlBackend``.
  native          the native one, or an error saying why it cannot load.
  python          always the Python backend (every post/poll/release takes the GIL).

The native transport is loaded with dlopen from the wheel's own library folder
(``site-packages/.nixl_cu12.mesonpy.libs/libnixl_capi.so``), so p2pweights builds and imports
without NIXL. The receiver side stays Python (``nixl.NixlReceiver``): both agents speak NIXL's
wire format, and the sender reads the same published descriptor (publication.py).
"""
from __future__ import annotations

import importlib.util
import os
import uuid
from pathlib import Path
from typing import Any

from .. import _native
from ..errors import NotFound, TransportError
from ..settings import value
from . import nixl  # noqa: F401  (sets the UCX defaults before any agent starts)
from .publication import check_descriptor_transport, parse_descriptor

NAME = "nixl"
PACKAGES = ("nixl_cu12", "nixl_cu13")


def capi_library() -> str | None:
    """Path of the installed NIXL wheel's libnixl_capi.so, or None (found without importing NIXL)."""
    for pkg in PACKAGES:
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin:
            continue
        lib = Path(spec.origin).resolve().parent.parent / f".{pkg}.mesonpy.libs" / "libnixl_capi.so"
        if lib.is_file():
            return str(lib)
    return None


class NativeNixlTransport(_native.NixlTransport):
    """``_native.NixlTransport`` whose ``connect`` takes the published descriptor (JSON)."""

    def __init__(self, library: str, *, backend: str | None = None, agent_name: str | None = None,
                 progress_delay: int | None = None):
        plugin = backend or value("P2PW_NIXL_BACKEND")
        delay = nixl.progress_delay_us() if progress_delay is None else int(progress_delay)
        name = agent_name or f"p2pw-sender-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        super().__init__(library, name, plugin, delay)

    def connect(self, engine: int, descriptor: str) -> None:
        desc = parse_descriptor(descriptor)
        check_descriptor_transport(desc, NAME)
        self.connect_peer(int(engine), desc.agent_metadata, desc.location)


def data_path() -> dict[str, Any]:
    """Which NIXL data path a sender would take here and why (for ``p2pweights doctor``), without
    starting an agent: {"path": "native"|"python", "library": str|None, "reason": str}."""
    mode = value("P2PW_NIXL_API")
    lib = capi_library()
    if mode == "python":
        return {"path": "python", "library": lib, "reason": "P2PW_NIXL_API=python"}
    if lib is None:
        return {"path": "python", "library": None,
                "reason": "no libnixl_capi.so in an installed nixl-cu12/nixl-cu13 wheel"}
    return {"path": "native", "library": lib, "reason": f"NIXL's C API ({lib})"}


def path_of(transport: Any) -> str:
    """"native" for a NativeNixlTransport, "python" for a Python backend behind PyTransport."""
    return "native" if isinstance(transport, _native.NixlTransport) else "python"


def make_nixl_transport(api: str | None = None, **opts: Any) -> Any:
    """The sender's NIXL transport (a ``_native.Transport``); api: auto | native | python (default
    P2PW_NIXL_API); opts: backend, progress_delay, agent_name."""
    mode = api or value("P2PW_NIXL_API")
    if mode != "python":
        lib = capi_library()
        if lib is not None:
            try:
                return NativeNixlTransport(lib, **opts)
            except NotFound as e:  # the library or a symbol is missing: the C API is unusable here
                if mode == "native":
                    raise TransportError(f"P2PW_NIXL_API=native, but NIXL's C API cannot be used: {e}") from None
        elif mode == "native":
            raise TransportError("P2PW_NIXL_API=native, but no installed nixl-cu12/nixl-cu13 wheel ships "
                                 "libnixl_capi.so; install one or set P2PW_NIXL_API=auto")
    return _native.PyTransport(nixl.NixlBackend(**opts))
