"""p2pweights inside a real sglang server: the general plugin sglang loads from the entry point
``p2pweights`` in group ``sglang.srt.plugins`` (pyproject.toml), and, for hosts without CUDA, an
out-of-tree platform (``cpu_platform``, group ``sglang.srt.platforms``).

sglang calls :func:`register` early in each of its processes (``sglang.srt.plugins.load_plugins``:
the launcher that also serves HTTP, the scheduler of every rank, the detokenizer, the DP
controller), then applies the hooks registered. ``SGLANG_PLUGINS`` (sglang's comma-separated
allow-list of plugin names) leaves the plugin out when it does not name ``p2pweights``.

Built so far: :func:`register` records which process kind loaded it (:data:`LOADS`) and adds
``p2pw_plugin`` to ``/server_info`` (``server_info.py``); in the process that serves HTTP it keeps
weight-update sessions with owners, leases and the torn state (``sessions.py``); it reports the
ranks' GPU architecture (``gpu_arch.py``) and puts the server's API key on the engine-info bootstrap
server (``bootstrap_key.py``); host-memory ranks take delta updates (``delta_updates.py``,
``rank_deltas.py``); a takeover revokes every rank's registrations under a new epoch (``fencing.py``,
``rank_epochs.py``); a drafting server publishes both roles in one table (``draft_roles.py``); a LoRA server's ranks
register and publish their adapter pool's slots and answer an adapter's slot (``lora_slots.py``); an
in-process ``sglang.Engine`` (no HTTP server, so no gate) is refused: its log, its server info and its
ranks' publications say why, and senders refuse to connect (``inprocess.py``); before registering
any hook it checks every hooked sglang function against the ones it was written for
(``version_guard.py``) and, on a mismatch, refuses to attach: an error in the log and in
``p2pw_plugin.error``. docs/sglang.md.

Every sglang process imports this module: it imports nothing of sglang but the hook registry.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import Any

from .. import __version__
from ..models.sglang_version import sglang_version
from . import server_info, version_guard

logger = logging.getLogger(__name__)

PLUGIN_NAME = "p2pweights"  # the entry-point name: what SGLANG_PLUGINS must list to keep it
CPU_PLATFORM = "p2pw_cpu"    # cpu_platform.NAME (not imported here: it imports torch and sglang's platforms)

# sglang's function that called load_plugins() -> the kind of process it runs in
_PROCESS_KINDS = {
    "run_scheduler_process": "scheduler",
    "run_detokenizer_process": "detokenizer",
    "run_data_parallel_controller_process": "dp_controller",
}

# One entry per register() in this process: {"kind", "pid", "error"}.
LOADS: list[dict[str, Any]] = []


def process_kind() -> str:
    """Which sglang process is loading the plugin, read from the function that called
    ``load_plugins()``: ``scheduler``, ``detokenizer``, ``dp_controller``, or ``main`` (the launcher,
    which also runs the HTTP server; an offline ``sglang.Engine``'s process)."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not (module.startswith("p2pweights.sglang_plugin") or module.startswith("sglang.srt.plugins")):
            return _PROCESS_KINDS.get(frame.f_code.co_name, "main")
        frame = frame.f_back
    return "main"


def register() -> None:
    """sglang's entry point: check the hooked functions, then register the hooks (or only the report
    of the refusal). Never raises: sglang logs a failing plugin and starts without it."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    kind = process_kind()
    if kind == "main" and os.environ.get("SGLANG_PLATFORM") == CPU_PLATFORM:
        # the guard imports sglang's HTTP server, which imports torchvision: on a host without it,
        # the CPU platform's stub must be in place first (sglang activates platforms lazily, later)
        from . import cpu_platform

        cpu_platform.activate()
    problems = version_guard.mismatches(kind=kind)
    error = None
    if problems:
        error = (f"p2pweights {__version__} refuses to attach to sglang {sglang_version()} "
                 f"(written for {version_guard.WRITTEN_FOR}): " + "; ".join(problems.values()))
        logger.error(error)  # ERROR reaches stderr even before sglang configures logging
    LOADS.append({"kind": kind, "pid": os.getpid(), "error": error})
    logger.info("p2pweights sglang plugin %s loaded in the %s process (pid %d)", __version__, kind, os.getpid())
    live = None
    if error is None and kind == "main":  # the launcher, which serves HTTP: sessions on sglang's app
        from . import sessions  # imports starlette and the receiver's session keeper: this process only

        HookRegistry.register(sessions.TARGET, sessions.before_http_server, HookType.BEFORE)
        live = sessions.live
    if error is None:  # the key on the engine-info bootstrap server; the ranks' GPU architecture; digests
        from . import bootstrap_key, delta_updates, digest, gpu_arch

        bootstrap_key.register(kind)
        gpu_arch.register(kind)
        digest.register(kind)  # POST /p2pw_weights_digest in the launcher, answered by each rank's scheduler
        fenced = None
        if kind == "main":  # a takeover revokes every rank's registrations (fencing.py)
            from . import fencing, inprocess

            fenced = fencing.live
            inprocess.register(kind)  # an in-process sglang.Engine has no gate: refused, loudly (inprocess.py)
        elif kind == "scheduler":  # before rank_deltas' hooks: inside them, the area is open (rank_epochs.py)
            from . import lora_slots, rank_epochs

            rank_epochs.register()
            lora_slots.register(kind)  # a LoRA pool registered and published; an adapter's slot (lora_slots.py)
        delta_updates.register(kind)  # delta areas published, claims answered, manifests applied in each scheduler
        live = server_info.combined(*(source for source in (live, bootstrap_key.live, digest.live, delta_updates.live,
                                                            fenced) if source is not None))
    if server_info.TARGET not in problems:  # else only the log can say it
        HookRegistry.register(server_info.TARGET, server_info.after_build(__version__, error, live), HookType.AFTER)
    if error is None and kind == "scheduler":  # where the model runs: weights in host memory (a CPU engine)
        from . import weight_registration  # registered with Mooncake; CUDA ones are left to sglang

        HookRegistry.register(weight_registration.TARGET, weight_registration.register_memory_region, HookType.AROUND)
        from . import rank_epochs

        rank_epochs.register_recorder()  # after it: what sglang (or the hook above) registers is recorded
        from . import draft_roles  # outermost: a draft's regions go to the target's engine, recorded

        draft_roles.register()
        if os.environ.get("SGLANG_PLATFORM") == CPU_PLATFORM:  # a drafting CPU server's KV pool and LM head
            from . import cpu_platform

            cpu_platform.register_scheduler_hooks()
    # Further hooks register here, only when error is None, each with its target in version_guard.HOOKED.

