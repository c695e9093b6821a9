"""vLLM 0.33's API server app, as far as it is built here, for tests: vLLM's own RL and dev routers,
exception handlers and middleware registration (``init_entrypoints_middleware``: ``--api-key``'s
``AuthenticationMiddleware`` and every ``--middleware``, so the gate is loaded by vLLM's own code
from its command-line option) on a FastAPI app, with an engine client that stands in for
``AsyncLLM``. ``build_app`` itself is not used: its instrumentator and SageMaker routers import
packages this host lacks; neither touches the routes the gate covers.

:class:`StandInEngineClient`: ``AsyncLLM``'s own weight-transfer methods (each is a
``collective_rpc``), over one connection per ``cpu_worker`` process (one per TP rank) instead of
vLLM's engine core; pause, resume and the weight version are kept here, as the engine core's
scheduler keeps them. Its LoRA methods (``add_lora``, ``remove_lora``, ``pin_lora``, ``list_loras``)
are vLLM's executor's: the same ``collective_rpc`` to every worker.

With ``lora=True``, :func:`api_app` mounts vLLM's own LoRA routes (``/v1/load_lora_adapter``,
``/v1/unload_lora_adapter``: ``vllm.entrypoints.serve.lora.api_router``) over vLLM's own
``OpenAIServingModels``. vLLM decorates them with SageMaker's adapter-handler registration from
``model_hosting_container_standards``, which this host lacks: while they are mounted, a stand-in
whose decorators return the route unchanged takes its place (SageMaker's own routes only).
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any


def _async_llm_method(name: str) -> Any:
    from vllm.v1.engine.async_llm import AsyncLLM

    return getattr(AsyncLLM, name)


class StandInEngineClient:
    """The API server's engine client (module docstring); ``addresses``: the cpu_workers', in rank
    order; ``authkey``: theirs."""

    def __init__(self, addresses: list[tuple[str, int]], authkey: bytes):
        from multiprocessing.connection import Client

        self._conns = [Client(tuple(address), authkey=authkey) for address in addresses]
        self._locks = [threading.Lock() for _ in self._conns]  # one call in flight per worker
        self.paused = False
        self.weight_version = "default"
        self.calls: list[str] = []  # what reached the workers (the tests read it)
        for name in ("init_weight_transfer_engine", "shutdown_weight_transfer_engine", "start_weight_update",
                     "start_draft_weight_update", "update_weights", "finish_weight_update"):
            setattr(self, name, _async_llm_method(name).__get__(self))  # vLLM's own, over collective_rpc

    def _call(self, rank: int, method: str, args: tuple, kwargs: dict) -> tuple[str, Any]:
        with self._locks[rank]:
            self._conns[rank].send((method, list(args), dict(kwargs)))
            return self._conns[rank].recv()

    async def collective_rpc(self, method: str, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None) -> list[Any]:
        """Every worker runs ``method`` at once (a rank's call may wait in a collective for the
        others'); their results in rank order, as vLLM's ``collective_rpc`` answers. A worker's error
        fails the call once every worker answered (none is left mid-call)."""
        self.calls.append(method if method != "weight_transfer_engine" else f"{method}:{args[0]}")
        answers = await asyncio.gather(*(asyncio.to_thread(self._call, rank, method, args, kwargs or {})
                                         for rank in range(len(self._conns))))
        failed = [f"rank {rank}: {result}" for rank, (status, result) in enumerate(answers) if status != "ok"]
        if failed:
            raise RuntimeError(f"Call to collective_rpc method {method!r} failed: {'; '.join(failed)}")
        return [result for _, result in answers]

    # ---- LoRA: vLLM's executor's methods (vllm/v1/executor/abstract.py), over collective_rpc ----------
    async def add_lora(self, lora_request: Any) -> bool:
        if lora_request.lora_int_id <= 0:
            raise ValueError("lora_id must be greater than 0.")
        return all(await self.collective_rpc("add_lora", args=(lora_request,)))

    async def remove_lora(self, lora_id: int) -> bool:
        return all(await self.collective_rpc("remove_lora", args=(int(lora_id),)))

    async def pin_lora(self, lora_id: int) -> bool:
        return all(await self.collective_rpc("pin_lora", args=(int(lora_id),)))

    async def list_loras(self) -> set[int]:
        sets = await self.collective_rpc("list_loras")
        if any(s != sets[0] for s in sets):
            raise RuntimeError("All workers should have the same LORAs.")
        return sets[0]

    async def compute_weight_checksums(self) -> list[dict[str, str]]:
        return await self.collective_rpc("compute_weight_checksums")

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        self.paused = True

    async def resume_generation(self) -> None:
        self.paused = False

    async def is_paused(self) -> bool:
        return self.paused

    async def update_weight_version(self, new_version: str) -> None:
        self.weight_version = new_version

    async def get_weight_version(self) -> str:
        return self.weight_version

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(("exit", [], {}))
            except OSError:
                pass
            conn.close()


def api_app(argv: list[str], client: Any, lora: bool = False) -> Any:
    """vLLM's routes and middleware for the command line ``argv`` (``--middleware ...``, ``--api-key``),
    answering through ``client``. Needs ``VLLM_SERVER_DEV_MODE=1`` for the dev routes it mounts.
    ``lora``: vLLM's LoRA routes too (module docstring); ``client.vllm_config`` must be set."""
    from fastapi import FastAPI
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.entrypoints.rl.factories import register_rl_api_routers
    from vllm.entrypoints.serve import register_vllm_dev_api_routers
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm.entrypoints.serve.middleware.register import init_entrypoints_middleware
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    app = FastAPI()
    app.state.args = args
    app.state.engine_client = client
    app.state.log_stats = False
    register_vllm_dev_api_routers(app)
    register_rl_api_routers(app)
    if lora:
        attach_lora_routes(app, client)
    init_exception_handler(app)
    init_entrypoints_middleware(args, app, ("generate",))
    return app


def attach_lora_routes(app: Any, client: Any) -> None:
    """vLLM's ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` over vLLM's own
    ``OpenAIServingModels`` (its registry of adapters by name, ``lora_requests``), as vLLM's API
    server sets them up (``app.state.openai_serving_models``)."""
    import sys
    import types

    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.lora import api_router

    config = client.vllm_config
    client.model_config = config.model_config
    client.renderer = client.input_processor = None  # OpenAIServingModels keeps them; its LoRA routes never read them
    app.state.openai_serving_models = OpenAIServingModels(
        client, [BaseModelPath(name=config.model_config.served_model_name or config.model_config.model,
                               model_path=config.model_config.model)])
    name = "model_hosting_container_standards"
    try:
        __import__(name + ".sagemaker")
        standin = None
    except ImportError:  # absent here: decorators that register nothing (module docstring)
        standin = types.ModuleType(name + ".sagemaker")
        standin.register_load_adapter_handler = standin.register_unload_adapter_handler = \
            lambda **_: (lambda route: route)
        sys.modules[name], sys.modules[name + ".sagemaker"] = types.ModuleType(name), standin
    try:
        api_router._attach_router(app)  # vLLM's own, less its VLLM_ALLOW_RUNTIME_LORA_UPDATING check
    finally:
        if standin is not None:
            sys.modules.pop(name, None)
            sys.modules.pop(name + ".sagemaker", None)
