"""The receiver's engine-rank pieces under their former home (``p2pweights.receiver.engine``), for
code written against it. The pieces live by job:

- :mod:`.region`: the weight region (every parameter of a rank in one registered allocation);
- :mod:`.rank`: :class:`EngineRank` (one rank's model, begin/end, the equality check, the
  broadcast path through a :class:`BroadcastReceiver`);
- :mod:`.rank_server`: HTTP between the leader and its ranks;
- :mod:`.hooks`: :class:`EngineHooks`, the leader's ``ReceiverHooks``;
- :mod:`.rank_process`: one rank process (``serve_rank``, its command line);
- :mod:`.launcher`: the fork server that starts rank processes, ``child_env``;
- :mod:`.local`: :class:`LocalEngine`, ``start_engine(s)``, ``check_weights_equal``;
- ``p2pweights.replica.reference``: the reference model the equality check compares with.

``python -m p2pweights.receiver.engine`` still runs one rank process (the flags of
:mod:`.rank_process`).
"""
from __future__ import annotations

import sys

from .hooks import EngineHooks
from .launcher import ForkedRank, Launcher, child_env, run_launcher
from .local import LocalEngine, check_weights_equal, free_port, start_engine, start_engines
from .rank import BroadcastReceiver, EngineRank
from .rank_process import READY_EVENT, main, serve_rank
from .rank_server import RANK_TIMEOUT
from .region import PAGE, PARAM_ALIGNMENT, WeightRegion, place_parameters

__all__ = ["PAGE", "PARAM_ALIGNMENT", "RANK_TIMEOUT", "READY_EVENT", "BroadcastReceiver", "EngineHooks", "EngineRank",
           "ForkedRank", "Launcher", "LocalEngine", "WeightRegion", "check_weights_equal", "child_env", "free_port",
           "main", "place_parameters", "run_launcher", "serve_rank", "start_engine", "start_engines"]

if __name__ == "__main__":
    if sys.argv[1:2] == ["--launcher"]:  # the former spelling of ``python -m p2pweights.receiver.launcher``
        import os

        os._exit(run_launcher())
    sys.exit(main(prog="python -m p2pweights.receiver.engine"))
