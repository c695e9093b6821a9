"""p2pweights inside vLLM 0.33: the ``p2pweights`` weight-transfer backend (docs/vllm.md, "The
p2pweights backend").

- :func:`register`, the ``vllm.general_plugins`` entry point ``p2pweights`` (pyproject.toml): vLLM
  runs it in each of its processes (the API server's argument parsing, the engine core, every
  worker), several times in one process too; it registers the backend name ``p2pweights`` with
  vLLM's ``WeightTransferEngineFactory`` by module path (loaded only where a worker creates it).
- ``engine.py``: the backend (``P2PWeightsEngine``), one per worker.
- ``rank_memory.py``: a worker's registrations, delta area and publication.
- ``gate.py``: the ASGI middleware for vLLM's API server (``--middleware
  p2pweights.vllm_backend.gate.SessionGate``): the API key on vLLM's RL and dev routes, the
  receiver's session rules (owner, lease, torn, epoch), deltas' base, and p2pweights' own routes.
- ``cpu_worker.py``: a vLLM worker on a host where vLLM's own worker cannot run (tests).

This package imports nothing of vLLM at import time.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BACKEND = "p2pweights"  # the name --weight-transfer-config '{"backend": "p2pweights"}' selects
ENGINE_MODULE, ENGINE_CLASS = "p2pweights.vllm_backend.transfer_engine", "P2PWeightsEngine"


def register() -> None:
    """vLLM's general-plugin entry point: register the backend with vLLM's factory, once per process
    (vLLM loads plugins several times in one process; its factory raises on a name registered twice)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(BACKEND, ENGINE_MODULE, ENGINE_CLASS)
    except ValueError as e:  # "... is already registered": an earlier load in this process did it
        if "already registered" not in str(e):
            raise
        return
    logger.debug("p2pweights: registered vLLM weight-transfer backend %r", BACKEND)
