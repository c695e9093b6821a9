"""The sglang functions the plugin hooks, as sglang 0.5.23 defines them, and the check that makes
the plugin refuse to attach to an sglang where one is missing or takes other parameters.

A hook on a function that changed would either never fire or misread its arguments; both fail
quietly. Checking each target's parameter names before registering anything turns that into one
loud refusal (the server's log and ``/server_info``'s ``p2pw_plugin.error``).
"""
from __future__ import annotations

import inspect
import pkgutil
from typing import Any, Mapping

WRITTEN_FOR = "0.5.23"

# Dotted target (as sglang's HookRegistry takes it) -> its parameter names in sglang 0.5.23.
# Every hook the plugin registers has its target here.
HOOKED: dict[str, tuple[str, ...]] = {
    # builds /server_info's answer for the HTTP server and the native gRPC server
    "sglang.srt.utils.common.build_server_info": ("server_args", "scheduler_info"),
}


def resolve(target: str) -> Any:
    """The object at ``target``; raises ImportError/AttributeError when sglang has none there."""
    return pkgutil.resolve_name(target)


def mismatch(target: str, parameters: tuple[str, ...]) -> str | None:
    """Why ``target`` is not the function the plugin was written for, or None when it is."""
    try:
        fn = resolve(target)
    except (ImportError, AttributeError, ValueError) as e:
        return f"{target} is missing ({type(e).__name__}: {e})"
    try:
        found = tuple(inspect.signature(fn).parameters)  # follows __wrapped__ through other hooks
    except (TypeError, ValueError):
        return f"{target} is not a function with a signature ({type(fn).__name__})"
    if found != parameters:
        return f"{target} takes ({', '.join(found)}), written for ({', '.join(parameters)})"
    return None


def mismatches(hooked: Mapping[str, tuple[str, ...]] | None = None) -> dict[str, str]:
    """Every hooked function that differs from sglang 0.5.23's -> why (empty: safe to attach)."""
    table = HOOKED if hooked is None else hooked
    found = {t: mismatch(t, p) for t, p in table.items()}
    return {t: why for t, why in found.items() if why is not None}
