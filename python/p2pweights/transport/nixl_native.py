"""The sender's NIXL data path: native (NIXL's C API, no GIL) or Python (NIXL's Python API).

``make_nixl_transport`` picks, by P2PW_NIXL_API:
  auto (default)  the native ``_native.NixlTransport`` when the installed NIXL wheel ships a usable
                  ``libnixl_capi.so`` and is a version csrc/transport/nixl_capi.h was checked against
                  (``_native.NIXL_CAPI_CHECKED_VERSIONS``); otherwise ``_native.PyTransport`` over
                  ``nixl.NixlBackend``. ``data_path()`` says which and why (``p2pweights doctor``).
  native          the native one, or an error saying why it cannot be used.
  python          always the Python backend (every post/poll/release takes the GIL).

The C API's declarations were read off one wheel's library (no headers ship): another NIXL release
may lay out its structs differently, so it is not dlopen'ed at all. A library that failed to load
is remembered for the process (here and in the native core) and not tried again.

The native transport is loaded with dlopen from the wheel's own library folder
(``site-packages/.nixl_cu12.mesonpy.libs/libnixl_capi.so``), so p2pweights builds and imports
without NIXL. The receiver side stays Python (``nixl.NixlReceiver``): both agents speak NIXL's
wire format, and the sender reads the same published descriptor (publication.py).
"""
from __future__ import annotations

import importlib.metadata
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
DISTRIBUTIONS = ("nixl-cu12", "nixl-cu13", "nixl")

#: library path -> why it failed to load (a failed dlopen is not retried in this process)
_load_failures: dict[str, str] = {}


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


def nixl_version() -> str | None:
    """The installed NIXL wheel's version (nixl-cu12, nixl-cu13 or nixl), or None."""
    for dist in DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _why_not_native(lib: str | None) -> str | None:
    """Why NIXL's C API at ``lib`` is not to be loaded, or None when it may be."""
    if lib is None:
        return "no libnixl_capi.so in an installed nixl-cu12/nixl-cu13 wheel"
    version, checked = nixl_version(), _native.NIXL_CAPI_CHECKED_VERSIONS
    if version not in checked:
        return (f"NIXL {version or '(version unknown)'} is not a version whose C API p2pweights was checked against "
                f"({', '.join(checked)}; csrc/transport/nixl_capi.h), so its library is not loaded")
    if lib in _load_failures:
        return f"NIXL's C API failed to load earlier in this process: {_load_failures[lib]}"
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
    why = _why_not_native(lib)
    if why is not None:
        return {"path": "python", "library": lib, "reason": why}
    return {"path": "native", "library": lib, "reason": f"NIXL's C API ({lib}, NIXL {nixl_version()})"}


def path_of(transport: Any) -> str:
    """"native" for a NativeNixlTransport, "python" for a Python backend behind PyTransport."""
    return "native" if isinstance(transport, _native.NixlTransport) else "python"


def make_nixl_transport(api: str | None = None, **opts: Any) -> Any:
    """The sender's NIXL transport (a ``_native.Transport``); api: auto | native | python (default
    P2PW_NIXL_API); opts: backend, progress_delay, agent_name."""
    mode = api or value("P2PW_NIXL_API")
    if mode != "python":
        lib = capi_library()
        why = _why_not_native(lib)
        if why is None:
            try:
                return NativeNixlTransport(lib, **opts)
            except NotFound as e:  # the library or a symbol is missing: the C API is unusable here
                _load_failures[lib] = str(e)
                why = f"NIXL's C API cannot be used: {e}"
        if mode == "native":
            fix = "install one or set P2PW_NIXL_API=auto" if lib is None else "set P2PW_NIXL_API=auto or python"
            raise TransportError(f"P2PW_NIXL_API=native, but {why}; {fix}")
    return _native.PyTransport(nixl.NixlBackend(**opts))
