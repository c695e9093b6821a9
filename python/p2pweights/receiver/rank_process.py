"""One engine-rank process: build the rank (:class:`EngineRank`), register and publish its region,
serve until told to stop.

Run one engine rank::

    python -m p2pweights.receiver.rank_process --model CONFIG_DIR --engine tp=2[,ep=..,dp_attention=..] \\
        --rank R --name ENGINE --transport {mooncake,nixl,auto} [--port P] [--leader URL] [--rank-ports P1,P2]

Rank 0 is the leader: it runs the engine's one ``ReceiverServer`` (the engine's URL, sglang's
routes) with :class:`LeaderHooks`, which fan the control verbs out to every rank. Ranks >= 1 serve
the internal control endpoint (:mod:`rank_server`) and register their regions and that endpoint
with the leader (``PUT /register_transfer_engine_info``); they exit when the leader goes away (or
is replaced) and every rank exits when the process that started it does. Each rank prints one
ready line, a JSON object, on stdout: ``{"event": "ready", "url", "pid", "rank", "control_url",
"engine", ...}``.

The engine's API key is ``P2PW_API_KEY`` in the rank's environment, never a flag (a command line
is readable by every local user): the leader's server and every rank's internal endpoint require
it, and ranks >= 1 send it to register with the leader.

The rank process chooses the rank's broadcast path (sglang's ``update_weights_from_distributed``
routes): the broadcast baseline's ``GroupReceiver`` (``--broadcast-receiver baseline``, the default),
or none (``none``: those routes fail). It is the one receiver module that imports the baseline;
:class:`EngineRank` is handed the object (any :class:`BroadcastReceiver`).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any, Callable, Sequence

from ..baseline.broadcast import GroupReceiver
from ..control import routes
from ..errors import EngineError
from ..replica.lora_layout import LoRASetting
from ..settings import TRANSPORTS
from ..settings import value as setting
from ..transport import resolve_transport
from .hooks import LeaderHooks
from .rank import BroadcastReceiver, EngineRank
from .rank_server import LeaderWatch, get_json, serve_rank_control
from .registration import RankEndpoints, parse_rank_ports, register_transfer_engine_info
from .registration import control_url as registration_control_url
from .server import ReceiverServer

logger = logging.getLogger(__name__)

READY_EVENT = "ready"
SERVER_INFO = routes.route("server_info").path
#: ``--broadcast-receiver``'s choices: the BroadcastReceiver each names (None: no broadcast path)
BROADCAST_RECEIVERS = {"baseline": GroupReceiver, "none": None}


def print_ready(**fields: Any) -> None:
    # one write(2) of one short line: atomic even when forked ranks share the launcher's stdout pipe
    os.write(1, (json.dumps({"event": READY_EVENT, **fields}) + "\n").encode())


def watch(check: Callable[[], bool], stop: threading.Event, interval: float = 0.5, misses: int = 4,
          why: str = "") -> None:
    """Set ``stop`` once ``check`` failed ``misses`` times in a row (a daemon thread)."""
    def loop() -> None:
        failed = 0
        while not stop.wait(interval):
            try:
                ok = check()
            except Exception:  # noqa: BLE001
                ok = False
            failed = 0 if ok else failed + 1
            if failed >= misses:
                logger.warning("exiting: %s", why)
                stop.set()
    threading.Thread(target=loop, name="p2pw-watchdog", daemon=True).start()


def serve_rank(config: str, engine: str, rank: int, *, name: str, transport: str, host: str = "127.0.0.1",
               port: int = 0, leader: str | None = None, parent_pid: int | None = None,
               startup_timeout: float = 120.0, broadcast: BroadcastReceiver | None = None,
               api_key: str | None = None, rank_ports: str | None = None, lora: Any = None) -> int:
    """The body of one rank process: build, register, publish, serve until told to stop.
    ``broadcast``: the rank's BroadcastReceiver (None: no broadcast path); ``api_key``: the
    engine's key (default ``P2PW_API_KEY``); ``rank_ports`` (rank 0): the control ports the launcher
    gave ranks 1, 2, ... ("P1,P2"): the leader accepts no other control URL (registration.py)."""
    api_key = setting("P2PW_API_KEY", api_key)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if parent_pid:
        watch(lambda: os.getppid() == parent_pid, stop, why=f"the parent process {parent_pid} is gone")

    er = EngineRank(config, engine, rank, transport=transport, name=name, broadcast=broadcast, lora=lora)
    peer, table, extra = er.published()
    closers: list[Callable[[], None]] = []
    try:
        if rank == 0:
            if leader:
                raise SystemExit("--leader is for ranks >= 1; rank 0 is the leader")
            instance = uuid.uuid4().hex
            endpoints = RankEndpoints(parse_rank_ports(rank_ports, host), host)
            server = ReceiverServer(LeaderHooks(er, instance, api_key=api_key, endpoints=endpoints), host=host,
                                    port=port, api_key=api_key).start()
            closers.append(server.close)
            server.register_transfer_engine_info(0, peer, table, extra)
            url = control_url = server.url
        else:
            if not leader:
                raise SystemExit("ranks >= 1 need --leader URL (rank 0's URL)")
            httpd = serve_rank_control(er, host, port, api_key=api_key)
            closers.append(lambda: (httpd.shutdown(), httpd.server_close()))
            control_url = registration_control_url(host, httpd.server_address[1])
            deadline = time.monotonic() + startup_timeout
            while True:  # the leader may still be starting
                try:
                    instance = get_json(leader, SERVER_INFO, api_key=api_key)["p2pw_instance"]
                    register_transfer_engine_info(leader, rank, peer, table, api_key=api_key,
                                                  extra={**extra, "p2pw_control_url": control_url})
                    break
                except (OSError, EngineError, KeyError, ValueError, TypeError) as e:
                    if time.monotonic() > deadline or stop.is_set():
                        raise SystemExit(f"rank {rank}: cannot register with the leader {leader}: {e}") from e
                    time.sleep(0.2)
            url = leader.rstrip("/")
            # gone = its port closed or another instance answering; busy (no answer, port open) is alive
            watch(LeaderWatch(leader, instance, api_key=api_key).check, stop,
                  why=f"the leader {leader} is gone or was replaced")
        print_ready(url=url, control_url=control_url, pid=os.getpid(), rank=rank, engine=name,
                    transport=transport, peer=peer, region=[er.region.address, er.region.nbytes],
                    startup_seconds=round(er.startup_seconds, 3))
        stop.wait()
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception:  # noqa: BLE001
                pass
        er.close()
    return 0


def main(argv: Sequence[str] | None = None, prog: str = "python -m p2pweights.receiver.rank_process") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="directory with the model's config.json")
    p.add_argument("--engine", default="tp=1", help="tp=2[,ep=..,dp_attention=..,<server arg>=v]")
    p.add_argument("--rank", type=int, default=0, help="this process's engine rank (0 = the leader)")
    p.add_argument("--name", default="engine0", help="the engine's name (logs, errors)")
    p.add_argument("--transport", default=None, choices=(*TRANSPORTS, "auto"),
                   help="default: P2PW_TRANSPORT (auto: nixl where NIXL's native path loads, else mooncake)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="rank 0: the engine's HTTP port; ranks >= 1: the rank's "
                                                       "control port (0: any free port)")
    p.add_argument("--leader", default=None, help="ranks >= 1: rank 0's URL")
    p.add_argument("--rank-ports", default=None, help="rank 0: the control ports given to ranks 1, 2, ... (P1,P2,...); "
                                                      "the leader accepts no other control URL")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer the parent")
    p.add_argument("--log-level", default=setting("P2PW_LOG_LEVEL"))
    p.add_argument("--broadcast-receiver", default="baseline", choices=sorted(BROADCAST_RECEIVERS),
                   help="what serves sglang's broadcast routes: the broadcast baseline's GroupReceiver, or none "
                        "(default: %(default)s)")
    p.add_argument("--lora", default=None, help="a LoRA setting as JSON (LoRASetting's fields): sglang's adapter pool "
                                                "on every rank (receiver/adapter_pool.py)")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"[%(asctime)s {args.name} rank {args.rank}] %(levelname)s %(name)s: %(message)s")
    chosen = BROADCAST_RECEIVERS[args.broadcast_receiver]
    broadcast = chosen() if chosen is not None else None
    transport = resolve_transport(args.transport)[0]
    code = serve_rank(args.model, args.engine, args.rank, name=args.name, transport=transport, host=args.host,
                      port=args.port, leader=args.leader, parent_pid=args.parent_pid, broadcast=broadcast,
                      rank_ports=args.rank_ports,
                      lora=LoRASetting(**json.loads(args.lora)) if args.lora else None)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: transports' destructors can hang at exit


if __name__ == "__main__":
    sys.exit(main())
