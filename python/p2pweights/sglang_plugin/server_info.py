"""What the plugin adds to sglang's ``/server_info``: ``p2pw_plugin`` = the p2pweights version, the
plugin protocol, what the plugin enforces in this server (``offers``: the sender reads it to know
which guarantees the engine gives), and, when the plugin (or one of its guarantees) refused to
attach, why; with sessions (``sessions.py``), ``p2pw_weight_update``, the session's state as a
receiver reports it.

It is an AFTER hook on sglang's own ``build_server_info`` (``sglang/srt/utils/common.py``), the
function that both the HTTP server's ``/server_info`` and the native gRPC server's GetServerInfo
call; nothing of sglang's route is copied.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from ..control.protocol import PLUGIN_FIELD as FIELD
from ..control.protocol import PLUGIN_GPU_ARCH
from ..control.protocol import PLUGIN_PROTOCOL as PROTOCOL
from . import gpu_arch

WEIGHT_UPDATE_FIELD = "p2pw_weight_update"  # the receiver's name for the session's state
TARGET = "sglang.srt.utils.common.build_server_info"
# PROTOCOL (control/protocol.py, where senders read it) is bumped whenever what the plugin adds to an
# engine (routes, fields, guarantees) changes meaning. 2: ``offers``; sessions (owner, lease, torn),
# /renew_weight_update, p2pw_weight_update. 3: ``gpu_arch`` (gpu_arch.py); the offer ``bootstrap_key``
# (bootstrap_key.py).


def plugin_info(version: str, error: str | None = None, offers: Iterable[str] = (),
                arch: str | None = None) -> dict[str, Any]:
    """The ``p2pw_plugin`` value: ``{"version", "protocol", "offers"}``, plus ``"gpu_arch"`` when the
    ranks run on a GPU and ``"error"`` when refused."""
    info: dict[str, Any] = {"version": version, "protocol": PROTOCOL, "offers": list(offers)}
    if arch is not None:
        info[PLUGIN_GPU_ARCH] = arch
    if error is not None:
        info["error"] = error
    return info


def combined(*sources: Callable[[], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
    """One ``live()`` of several (``sessions.live``, ``bootstrap_key.live``, ...): their offers in
    order, their errors joined, the first ``weight_update`` given."""

    def live() -> dict[str, Any]:
        now = [source() for source in sources]
        errors = [n["error"] for n in now if n.get("error")]
        return {"offers": [o for n in now for o in n.get("offers", ())],
                "error": "; ".join(errors) or None,
                "weight_update": next((n["weight_update"] for n in now if n.get("weight_update") is not None), None)}

    return live


def after_build(version: str, error: str | None = None,
                live: Callable[[], dict[str, Any]] | None = None) -> Callable[..., Any]:
    """The AFTER hook: ``hook(result, *args, **kwargs)`` adds the fields to the dict sglang built.
    ``live()`` (read at each call) says what the plugin enforces now: ``{"offers", "error",
    "weight_update"}`` (``sessions.live``)."""

    def add_plugin_info(result: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(result, dict):
            now = live() if live is not None else {}
            refusal = "; ".join(why for why in (error, now.get("error")) if why) or None
            arch = result.pop(gpu_arch.KEY, None)  # the first scheduler's (gpu_arch.py), in its init info
            result[FIELD] = plugin_info(version, refusal, now.get("offers", ()), arch)
            if now.get("weight_update") is not None:
                result[WEIGHT_UPDATE_FIELD] = now["weight_update"]
        return result

    return add_plugin_info
