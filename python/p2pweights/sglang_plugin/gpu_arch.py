"""The GPU architecture of a real sglang server's ranks, for ``/server_info``'s
``p2pw_plugin.gpu_arch`` (protocol 3): a sender needs it for FP8 checkpoints, whose post-processing
depends on it (``replica/build_check.py``), and sglang does not report it.

Where it is computed: in each rank's scheduler process, when the scheduler is ready. That process
has already set up CUDA on the rank's own device (the model runner loaded the weights there), so
asking that device costs nothing. The architecture is named by the receiver's own
``build_report.device_arch`` (``sm90``, ``gfx942``), the spelling a receiver's ranks report. The
launcher, which answers ``/server_info``, never touches CUDA for it: sglang keeps CUDA
uninitialised there on purpose (``get_device_sm`` asks NVML instead, to keep ``fork()`` safe).

How it reaches the launcher: an AFTER hook on sglang's ``Scheduler.get_init_info``, the dict each
scheduler sends the launcher once ready, adds :data:`KEY`. sglang merges the first scheduler's dict
into what ``build_server_info`` returns, and ``server_info.after_build`` moves :data:`KEY` into
``p2pw_plugin``. With data parallelism a DP controller sends the launcher its own dict, built from
its schedulers' dicts; an AFTER hook on ``DataParallelController.get_init_info`` carries the key
over. A server whose ranks do not run on CUDA (sglang's ``device`` is not ``cuda``: the CPU, NPU,
XPU) reports no architecture.
"""
from __future__ import annotations

from typing import Any

from ..receiver.build_report import device_arch

SCHEDULER_TARGET = "sglang.srt.managers.scheduler.Scheduler.get_init_info"
DP_CONTROLLER_TARGET = "sglang.srt.managers.data_parallel_controller.DataParallelController.get_init_info"
KEY = "p2pw_gpu_arch"  # in a scheduler's init info; never left in /server_info's top level


def rank_gpu_arch(device: Any) -> str | None:
    """The architecture of this rank's GPU (sglang's ``device`` and this process's ``gpu_id``), or
    None where the rank does not run on CUDA (ROCm's torch is ``cuda`` too)."""
    if str(device).split(":", 1)[0] != "cuda":
        return None
    from sglang.srt.runtime_context import get_device

    return device_arch(f"cuda:{int(get_device().gpu_id)}")


def after_scheduler_init_info(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """The AFTER hook on ``Scheduler.get_init_info``: adds :data:`KEY` for a rank on a GPU."""
    if isinstance(result, dict):
        arch = rank_gpu_arch(getattr(scheduler, "device", None))
        if arch is not None:
            result[KEY] = arch
    return result


def after_dp_controller_init_info(result: Any, controller: Any, *args: Any, **kwargs: Any) -> Any:
    """The AFTER hook on ``DataParallelController.get_init_info``: keeps its schedulers' :data:`KEY`
    (the first that has one), which the controller's own dict leaves out."""
    if isinstance(result, dict) and KEY not in result:
        for info in list(getattr(controller, "_scheduler_init_infos", None) or ()):
            if isinstance(info, dict) and info.get(KEY):
                result[KEY] = info[KEY]
                break
    return result


def register(kind: str) -> None:
    """Register the hook of a process of ``kind`` (``sglang_plugin.process_kind``): the scheduler's or
    the DP controller's; none elsewhere."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if kind == "scheduler":
        HookRegistry.register(SCHEDULER_TARGET, after_scheduler_init_info, HookType.AFTER)
    elif kind == "dp_controller":
        HookRegistry.register(DP_CONTROLLER_TARGET, after_dp_controller_init_info, HookType.AFTER)
