"""The sglang functions the plugin hooks, as sglang 0.5.23 defines them, and the check that makes
the plugin refuse to attach to an sglang where one is missing or takes other parameters.

A hook on a function that changed would either never fire or misread its arguments; both fail
quietly. Checking each target's parameter names before registering anything turns that into one
loud refusal (the server's log and ``/server_info``'s ``p2pw_plugin.error``).
"""
from __future__ import annotations

import importlib
import inspect
import os
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
    # registers a rank's weights with Mooncake; the hook takes host-memory weights (weight_registration.py)
    "sglang.srt.model_loader.remote_instance_weight_loader_utils.register_memory_region": (
        "model", "transfer_engine"),
    # a scheduler's (a DP controller's) ready message to the launcher: the rank's GPU architecture (gpu_arch.py)
    "sglang.srt.managers.scheduler.Scheduler.get_init_info": ("self",),
    "sglang.srt.managers.data_parallel_controller.DataParallelController.get_init_info": ("self",),
    # the engine-info bootstrap server, built and started, and its FastAPI app's arguments: the key's
    # guard goes in (bootstrap_key.py)
    "sglang.srt.entrypoints.engine_info_bootstrap_server.EngineInfoBootstrapServer.__init__": ("self", "host", "port"),
    "sglang.srt.entrypoints.engine_info_bootstrap_server.fastapi_telemetry_disabled_kwargs": (),
    # a rank's PUT of its weights table to the bootstrap server: it carries the key (bootstrap_key.py)
    ("sglang.srt.model_executor.model_runner_components.remote_instance_weight_transporter."
     "RemoteInstanceWeightTransporter._register_to_engine_info_bootstrap"): ("self",),
    # a rank's scheduler answers sglang's weight checker: the digest action (digest.py)
    ("sglang.srt.managers.scheduler_components.weight_updater."
     "SchedulerWeightUpdaterManager.check_weights"): ("self", "recv_req"),
    # a runner's transporter is built: which runner is the draft's (draft_roles.py)
    "sglang.srt.model_executor.model_runner.ModelRunner.init_remote_instance_weight_transporter": ("self",),
    # the KV pool's Triton warm-up, skipped on the p2pw_cpu platform (cpu_platform.py)
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup": ("self",),
    # the draft takes the target's embedding and head: no CUDA synchronize on the p2pw_cpu platform
    "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.init_lm_head": ("self",),
    # sglang has no draft-extend backend for torch_native: the draft keeps its own (cpu_platform.py)
    "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_draft_extend_backend": ("self",),
    # a runner's LoRA manager is built (its pool registered and published: lora_slots.py; no pinning on
    # the p2pw_cpu platform: cpu_platform.py), and a batch's LoRA state prepared (no pinning there either)
    "sglang.srt.model_executor.model_runner.ModelRunner.init_lora_manager": ("self",),
    "sglang.srt.lora.lora_manager.LoRAManager.prepare_lora_batch": ("self", "forward_batch"),
    # an in-process sglang.Engine is built, and answers its own get_server_info(): refused (inprocess.py)
    "sglang.srt.entrypoints.engine.Engine.__init__": ("self", "kwargs"),
    "sglang.srt.entrypoints.engine.Engine.get_server_info": ("self",),
    # not sglang's: how sglang's own calls of the bootstrap server are sent (bootstrap_key.py)
    "requests.sessions.Session.request": (
        "self", "method", "url", "params", "data", "headers", "cookies", "files", "auth", "timeout",
        "allow_redirects", "proxies", "hooks", "stream", "verify", "cert", "json"),
}
#: targets hooked only in the process that serves HTTP (the launcher, kind ``main``): elsewhere they
#: are neither checked nor imported (the scheduler would import the whole HTTP server for nothing)
HTTP_PROCESS_ONLY = frozenset({"sglang.srt.entrypoints.http_server._setup_and_run_http_server"})
#: targets hooked only in processes of the kinds named (elsewhere neither checked nor imported)
ONLY_IN: dict[str, frozenset[str]] = {
    "sglang.srt.managers.scheduler.Scheduler.get_init_info": frozenset({"scheduler"}),
    "sglang.srt.managers.data_parallel_controller.DataParallelController.get_init_info": frozenset({"dp_controller"}),
    "sglang.srt.entrypoints.engine_info_bootstrap_server.EngineInfoBootstrapServer.__init__": frozenset({"main"}),
    "sglang.srt.entrypoints.engine_info_bootstrap_server.fastapi_telemetry_disabled_kwargs": frozenset({"main"}),
    ("sglang.srt.model_executor.model_runner_components.remote_instance_weight_transporter."
     "RemoteInstanceWeightTransporter._register_to_engine_info_bootstrap"): frozenset({"scheduler"}),
    "requests.sessions.Session.request": frozenset({"main", "scheduler"}),
    "sglang.srt.entrypoints.engine.Engine.__init__": frozenset({"main"}),
    "sglang.srt.entrypoints.engine.Engine.get_server_info": frozenset({"main"}),
    # hooked in the schedulers; checked in the launcher too (its sglang.srt.entrypoints.engine imports the
    # module anyway), so that it never offers a digest its schedulers cannot answer
    ("sglang.srt.managers.scheduler_components.weight_updater."
     "SchedulerWeightUpdaterManager.check_weights"): frozenset({"main", "scheduler"}),
    "sglang.srt.model_loader.remote_instance_weight_loader_utils.register_memory_region": frozenset({"scheduler"}),
    "sglang.srt.model_executor.model_runner.ModelRunner.init_remote_instance_weight_transporter": frozenset({"scheduler"}),
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup": frozenset({"scheduler"}),
    "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.init_lm_head": frozenset({"scheduler"}),
    "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_draft_extend_backend": frozenset({"scheduler"}),
    "sglang.srt.model_executor.model_runner.ModelRunner.init_lora_manager": frozenset({"scheduler"}),
    "sglang.srt.lora.lora_manager.LoRAManager.prepare_lora_batch": frozenset({"scheduler"}),
}


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


#: targets hooked only on the plugin's ``p2pw_cpu`` platform (cpu_platform.py): a GPU server neither
#: hooks nor checks them, so a change there in another sglang never refuses the plugin on a GPU
CPU_PLATFORM_ONLY = frozenset({
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._init_kv_copy_and_warmup",
    "sglang.srt.speculative.eagle_worker_v2.EagleDraftWorker.init_lm_head",
    "sglang.srt.speculative.draft_utils.DraftBackendFactory.create_draft_extend_backend",
    "sglang.srt.lora.lora_manager.LoRAManager.prepare_lora_batch",
})


def hooked_in(kind: str, cpu_platform: bool | None = None) -> dict[str, tuple[str, ...]]:
    """The targets the plugin hooks in a process of ``kind`` (``sglang_plugin.process_kind``);
    ``cpu_platform``: whether the server runs on ``p2pw_cpu`` (None: ``SGLANG_PLATFORM`` says)."""
    if cpu_platform is None:
        cpu_platform = os.environ.get("SGLANG_PLATFORM") == "p2pw_cpu"  # cpu_platform.NAME (not imported: torch)
    return {t: p for t, p in HOOKED.items()
            if (kind == "main" or t not in HTTP_PROCESS_ONLY) and kind in ONLY_IN.get(t, (kind,))
            and (cpu_platform or t not in CPU_PLATFORM_ONLY)}


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
