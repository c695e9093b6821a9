"""The sglang functions the plugin hooks, as sglang 0.5.23 defines them, and the check that makes
the plugin refuse to attach to an sglang where one is missing or takes other parameters.

A hook on a function that changed would either never fire or misread its arguments; both fail
quietly. Checking each target's parameter names before registering anything turns that into one
loud refusal (the server's log and ``/server_info``'s ``p2pw_plugin.error``).
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any, Mapping

WRITTEN_FOR = "0.5.23"

# Dotted target (as sglang's HookRegistry takes it) -> its parameter names in sglang 0.5.23.
# Every hook the plugin registers has its target here.
HOOKED: dict[str, tuple[str, ...]] = {
    # builds /server_info's answer for the HTTP server and the native gRPC server
    "sglang.srt.utils.common.build_server_info": ("server_args", "scheduler_info"),
    # runs the HTTP server on the FastAPI app, after the engine's subprocesses started (sessions.py)
    "sglang.srt.entrypoints.http_server._setup_and_run_http_server": (
        "server_args", "tokenizer_manager", "template_manager", "port_args", "scheduler_infos",
        "subprocess_watchdog", "execute_warmup_func", "launch_callback"),
}
#: targets hooked only in the process that serves HTTP (the launcher, kind ``main``): elsewhere they
#: are neither checked nor imported (the scheduler would import the whole HTTP server for nothing)
HTTP_PROCESS_ONLY = frozenset({"sglang.srt.entrypoints.http_server._setup_and_run_http_server"})


def resolve(target: str) -> Any:
    """The object at ``target``; raises ImportError/AttributeError when sglang has none there."""
    return pkgutil.resolve_name(target)


def mismatch(target: str, parameters: tuple[str, ...]) -> str | None:
    """Why ``target`` is not the function the plugin was written for, or None when it is."""
    try:
        fn = resolve(target)
    except (ImportError, AttributeError, ValueError) as e:
        return f"{target} is missing ({_import_failure(target) or f'{type(e).__name__}: {e}'})"
    try:
        found = tuple(inspect.signature(fn).parameters)  # follows __wrapped__ through other hooks
    except (TypeError, ValueError):
        return f"{target} is not a function with a signature ({type(fn).__name__})"
    if found != parameters:
        return f"{target} takes ({', '.join(found)}), written for ({', '.join(parameters)})"
    return None


def hooked_in(kind: str) -> dict[str, tuple[str, ...]]:
    """The targets the plugin hooks in a process of ``kind`` (``sglang_plugin.process_kind``)."""
    return {t: p for t, p in HOOKED.items() if kind == "main" or t not in HTTP_PROCESS_ONLY}


def _import_failure(target: str) -> str | None:
    """Why a module on ``target``'s path failed to import (pkgutil reports only the attribute it then
    lacks), or None when every module there imports."""
    parts = target.split(".")
    for n in range(len(parts) - 1, 0, -1):
        name = ".".join(parts[:n])
        try:
            importlib.import_module(name)
            return None
        except ModuleNotFoundError as e:
            if e.name and (name == e.name or name.startswith(e.name + ".")):
                continue  # not a module (a class, a function), or no such module: look further up
            return f"importing {name} failed: {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - whatever the import raised is the reason
            return f"importing {name} failed: {type(e).__name__}: {e}"
    return None


def mismatches(hooked: Mapping[str, tuple[str, ...]] | None = None, kind: str = "main") -> dict[str, str]:
    """Every function hooked in a process of ``kind`` (or in ``hooked``) that differs from sglang
    0.5.23's -> why (empty: safe to attach)."""
    table = hooked_in(kind) if hooked is None else hooked
    found = {t: mismatch(t, p) for t, p in table.items()}
    return {t: why for t, why in found.items() if why is not None}
