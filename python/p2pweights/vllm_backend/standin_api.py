"""vLLM 0.33's API server app, as far as it is built here, for tests: vLLM's own RL and dev routers,
exception handlers and middleware registration (``init_entrypoints_middleware``: ``--api-key``'s
``AuthenticationMiddleware`` and every ``--middleware``, so the gate is loaded by vLLM's own code
from its command-line option) on a FastAPI app, with an engine client that stands in for
``AsyncLLM``. ``build_app`` itself is not used: its instrumentator and SageMaker routers import
packages this host lacks; neither touches the routes the gate covers.

:class:`StandInEngineClient`: ``AsyncLLM``'s own weight-transfer methods (each is a
``collective_rpc``), over one connection per ``cpu_worker`` process (one per TP rank) instead of
vLLM's engine core; pause, resume and the weight version are kept here, as the engine core's
scheduler keeps them.
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


def api_app(argv: list[str], client: Any) -> Any:
    """vLLM's routes and middleware for the command line ``argv`` (``--middleware ...``, ``--api-key``),
    answering through ``client``. Needs ``VLLM_SERVER_DEV_MODE=1`` for the dev routes it mounts."""
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
    init_exception_handler(app)
    init_entrypoints_middleware(args, app, ("generate",))
    return app
