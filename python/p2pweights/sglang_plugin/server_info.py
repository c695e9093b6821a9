"""What the plugin adds to sglang's ``/server_info``: ``p2pw_plugin`` = the p2pweights version, the
plugin protocol the sender reads to know which guarantees the engine offers, and, when the plugin
refused to attach, why.

It is an AFTER hook on sglang's own ``build_server_info`` (``sglang/srt/utils/common.py``), the
function that both the HTTP server's ``/server_info`` and the native gRPC server's GetServerInfo
call; nothing of sglang's route is copied.
"""
from __future__ import annotations

from typing import Any, Callable

FIELD = "p2pw_plugin"
TARGET = "sglang.srt.utils.common.build_server_info"
# Bumped whenever what the plugin adds to an engine (routes, fields, guarantees) changes meaning.
PROTOCOL = 1


def plugin_info(version: str, error: str | None = None) -> dict[str, Any]:
    """The ``p2pw_plugin`` value: ``{"version", "protocol"}``, plus ``"error"`` when refused."""
    info: dict[str, Any] = {"version": version, "protocol": PROTOCOL}
    if error is not None:
        info["error"] = error
    return info


def after_build(version: str, error: str | None = None) -> Callable[..., Any]:
    """The AFTER hook: ``hook(result, *args, **kwargs)`` adds the field to the dict sglang built."""
    info = plugin_info(version, error)

    def add_plugin_info(result: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(result, dict):
            result[FIELD] = dict(info)
        return result

    return add_plugin_info
