"""A receiver engine made of real sglang model ranks: one process per engine rank.

Run one engine rank::

    python -m p2pweights.receiver.engine --model CONFIG_DIR --engine tp=2[,ep=..,dp_attention=..] \\
        --rank R --name ENGINE --transport {mooncake,nixl} [--port P] [--leader URL]

Each rank process builds sglang's model class of its rank (``replica.sglang_env.build_model``) and
places every parameter in ONE contiguous, page-aligned host allocation (each parameter keeps its
class and ``__dict__``), registers that allocation once with the transport, and publishes sglang's
per-rank table ``{name: [data_ptr, numel, element_size]}`` (plus NIXL's agent metadata).

Rank 0 is the leader: it runs the engine's one ``ReceiverServer`` (the engine's URL, sglang's
routes) and fans the control verbs (begin, end, the checks, the broadcast routes) out to every
rank. Ranks >= 1 serve a small control endpoint (``POST /p2pw_rank/<verb>``) and register their
regions and that endpoint with the leader (``PUT /register_transfer_engine_info``); they exit when
the leader goes away (or is replaced) and every rank exits when the process that started it does.
Each rank prints one ready line, a JSON object, on stdout: ``{"event": "ready", "url", "pid",
"rank", "control_url", "engine"}``.

From Python (tests, the demo)::

    engine = start_engine(config_dir, "tp=2", transport="mooncake", name="engine0")  # T processes
    engine.url                              # http://127.0.0.1:PORT, sglang's routes
    check_weights_equal(engine.url, hf_seed=7)  # {"success", "message", "ranks": [...]}
    engine.kill(rank=1); engine.restart()     # faults: same port again
    engine.close()
"""
from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Callable, Sequence
from urllib.parse import urlsplit

from ..errors import EngineError
from .server import ReceiverHooks, ReceiverServer, register_transfer_engine_info, send_json

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

PAGE = 4096
PARAM_ALIGNMENT = 256          # every parameter starts on this boundary inside the region
RANK_TIMEOUT = 600.0           # leader -> rank control calls (end and the check can take a while)
READY_EVENT = "ready"


# ---- the rank's model with its parameters in one allocation ---------------------------------------

@dataclass
class WeightRegion:
    """One host allocation holding every parameter of a rank: ``offsets[name] = (offset, nbytes)``."""

    storage: "torch.Tensor"     # the aligned uint8 view (keep alive)
    address: int
    nbytes: int
    offsets: dict[str, tuple[int, int]]


def _aligned_bytes(nbytes: int, device: str = "cpu") -> tuple["torch.Tensor", "torch.Tensor"]:
    import torch

    raw = torch.zeros(nbytes + PAGE, dtype=torch.uint8, device=device)
    skip = (-raw.data_ptr()) % PAGE
    return raw, raw[skip:skip + nbytes]


def _fresh_param(old: "torch.nn.Parameter", data: "torch.Tensor") -> "torch.nn.Parameter":
    """A parameter of ``old``'s class and ``__dict__`` (weight_loader, output_dim, ...) on ``data``."""
    import torch

    new = torch.nn.Parameter(data, requires_grad=old.requires_grad)
    new.__class__ = old.__class__
    new.__dict__.update(old.__dict__)
    return new


def _replace_parameters(model: "torch.nn.Module", make: Callable[[str, "torch.nn.Parameter"], "torch.Tensor"]) -> None:
    """Swap every parameter for one on ``make(name, old)``'s storage; shared (tied) parameters stay shared."""
    done: dict[int, Any] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for module in model.modules():
        for key, old in list(module._parameters.items()):
            if old is None:
                continue
            if id(old) not in done:
                done[id(old)] = _fresh_param(old, make(names[id(old)], old))
            module._parameters[key] = done[id(old)]


def _materialize_rest(model: "torch.nn.Module") -> None:
    """Zero-filled CPU storage for buffers and tensor attributes still on the meta device."""
    import torch

    for module in model.modules():
        for key, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[key] = torch.zeros(buf.shape, dtype=buf.dtype)
        for key, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter) and value.is_meta:
                setattr(module, key, torch.zeros(value.shape, dtype=value.dtype))


def place_parameters(model: "torch.nn.Module", alignment: int = PARAM_ALIGNMENT, device: str = "cpu") -> WeightRegion:
    """Put every parameter of a meta-built model into one zeroed, page-aligned allocation (host, or
    GPU memory with ``device="cuda:N"``), in
    ``named_parameters`` order, each on an ``alignment`` boundary; materialize the rest."""
    offsets: dict[str, tuple[int, int]] = {}
    total = 0
    for name, p in model.named_parameters():
        n = p.numel() * p.element_size()
        offsets[name] = (total, n)
        total += (n + alignment - 1) // alignment * alignment
    raw, region = _aligned_bytes(max(total, 1), device)

    def make(name: str, old: "torch.nn.Parameter") -> "torch.Tensor":
        off, n = offsets[name]
        return region[off:off + n].view(old.dtype).view(old.shape)

    _replace_parameters(model, make)
    _materialize_rest(model)
    model._p2pw_region_raw = raw  # type: ignore[attr-defined]  # keeps the allocation alive
    return WeightRegion(region, int(region.data_ptr()), int(total), offsets)


def materialize_rank_model(model: "torch.nn.Module") -> "torch.nn.Module":
    """Real, zeroed CPU storage for a meta-built model (parameters keep class and ``__dict__``)."""
    import torch

    _replace_parameters(model, lambda name, old: torch.zeros(old.shape, dtype=old.dtype))
    _materialize_rest(model)
    return model


class EngineRank:
    """One engine rank in this process: the live model in one registered region, its publication,
    its post-processing, the equality check and the broadcast receiver."""

    def __init__(self, config: str, engine: Any, rank: int, transport: str = "mooncake", name: str = "engine"):
        from ..replica import sglang_env
        from ..replica.layout import EngineLayout
        from ..transport import make_receiver_endpoint, params_table
        from .reference import ReferenceModel

        t0 = time.perf_counter()
        self.config = os.fspath(config)
        self.engine = engine if isinstance(engine, EngineLayout) else EngineLayout.parse(str(engine))
        self.rank = int(rank)
        self.name = name
        self.transport = transport
        if not 0 <= self.rank < self.engine.world_size:
            raise ValueError(f"rank {rank} is not a rank of an engine of {self.engine.world_size} ranks")
        # P2PW_RECEIVER_DEVICE=cuda[:N]: parameters in GPU memory (VRAM registration), as on a real engine.
        self.device = os.environ.get("P2PW_RECEIVER_DEVICE", "cpu")
        if self.device == "cuda":
            self.device = "cuda:0"
        gpus = os.environ.get("P2PW_RECEIVER_GPUS")  # "1,2,3,4": engine rank r on GPU gpus[r]
        if gpus:
            self.device = f"cuda:{gpus.split(',')[self.rank]}"
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.set_device(torch.device(self.device))
        self.model = sglang_env.build_model(self.config, self.engine, self.rank, device="meta")
        self.region = place_parameters(self.model, device=self.device)
        self.endpoint = make_receiver_endpoint(transport)
        self.endpoint.register(self.region.address, self.region.nbytes, self.device)
        self.publication = self.endpoint.publication(params_table(self.model.named_parameters()), rank=self.rank)
        self.reference = ReferenceModel(self.config, self.engine, self.rank)
        self.loaded_weights = False   # a loader ran in this session (the broadcast path)
        self._groups: dict[str, Any] = {}
        self._group_devices: dict[str, str] = {}  # where a group's broadcast tensors land (nccl: this GPU)
        self._lock = threading.RLock()
        self.startup_seconds = time.perf_counter() - t0

    # -- what is published ---------------------------------------------------------------------
    def published(self) -> tuple[str, dict, dict]:
        """(session id / agent name, sglang's weights table, extra publication keys such as NIXL's)."""
        d = self.publication.to_dict()
        peer, table = d.pop("remote_instance_transfer_engine_info")
        d.pop("rank", None)
        return peer, table, d

    # -- the update session ----------------------------------------------------------------------
    def begin(self, selector: str = "all") -> None:
        import torch
        from sglang.srt.model_loader.loader import DefaultModelLoader

        from ..replica import sglang_env

        with self._lock, sglang_env.activate(self.model):
            DefaultModelLoader.restore_weights_before_loading(self.model, torch.device(self.device))
            self.loaded_weights = False

    def end(self) -> None:
        """sglang's end_weight_update: post_load_weights (unless a loader ran, which did it) and
        process_weights_after_loading of every module with a quant method."""
        import torch
        from sglang.srt.model_loader.loader import DefaultModelLoader, post_load_weights

        from ..replica import sglang_env

        with self._lock, sglang_env.activate(self.model):
            if not self.loaded_weights:
                post_load_weights(self.model)
            DefaultModelLoader.postprocess_weights(self.model, torch.device(self.device))
            self.loaded_weights = False

    # -- checks ------------------------------------------------------------------------------------
    def compare(self, hf_seed: int, skip: Sequence[str] = ()) -> dict:
        with self._lock:
            return self.reference.compare(self.model, int(hf_seed), skip).to_dict()

    def checksum(self) -> dict:
        import hashlib

        from .reference import _as_bytes, named_state

        h = hashlib.sha256()
        with self._lock:
            for name, t in sorted(named_state(self.model).items()):
                h.update(name.encode())
                h.update(_as_bytes(t).numpy().tobytes())
        return {"rank": self.rank, "checksum": h.hexdigest()}

    def weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        params = dict(self.model.named_parameters())
        if name not in params:
            return None
        return params[name].detach()[:truncate_size].float().tolist()

    # -- the broadcast path ------------------------------------------------------------------------
    def init_group(self, request: dict) -> None:
        from ..baseline.broadcast import join_weight_update_group

        name = request["group_name"]
        if name in self._groups:
            raise RuntimeError(f"group {name!r} already exists on rank {self.rank}")
        self._group_devices[name] = self.device if request["backend"] == "nccl" else "cpu"
        self._groups[name] = join_weight_update_group(
            request["backend"], request["master_address"], request["master_port"], request["world_size"],
            request["rank_offset"] + self.rank, name, timeout=float(request.get("timeout", 120.0)))

    def update_from_distributed(self, request: dict) -> None:
        import torch
        import torch.distributed as dist

        from ..replica import sglang_env

        group = self._groups.get(request["group_name"])
        if group is None:
            raise RuntimeError(f"group {request['group_name']!r} is not initialized on rank {self.rank}; "
                               f"call init_weights_update_group first")
        weights = []
        for name, dtype, shape in zip(request["names"], request["dtypes"], request["shapes"]):
            t = torch.empty([int(s) for s in shape], dtype=getattr(torch, str(dtype).removeprefix("torch.")),
                            device=self._group_devices.get(request["group_name"], "cpu"))
            dist.broadcast(t, src=0, group=group)
            weights.append((name, t))
        with self._lock, sglang_env.activate(self.model):
            self.model.load_weights(weights)
            self.loaded_weights = True

    def destroy_group(self, group_name: str) -> None:
        from ..baseline.broadcast import leave_weight_update_group

        group = self._groups.pop(group_name, None)
        if group is None:
            raise RuntimeError(f"the group {group_name!r} does not exist on rank {self.rank}")
        leave_weight_update_group(group)

    def close(self) -> None:
        for name in list(self._groups):
            try:
                self.destroy_group(name)
            except Exception:  # noqa: BLE001 - best effort at exit
                pass
        try:
            self.endpoint.close()
        except Exception:  # noqa: BLE001
            pass

    # -- the verbs a leader calls on each rank (same names over HTTP) -------------------------------
    def call(self, verb: str, body: dict) -> Any:
        if verb == "begin":
            return self.begin(body.get("selector", "all"))
        if verb == "end":
            return self.end()
        if verb == "compare":
            return self.compare(int(body["hf_seed"]), body.get("skip") or ())
        if verb == "checksum":
            return self.checksum()
        if verb == "init_group":
            return self.init_group(body)
        if verb == "update_from_distributed":
            return self.update_from_distributed(body)
        if verb == "destroy_group":
            return self.destroy_group(body["group_name"])
        if verb == "ping":
            return {"rank": self.rank, "pid": os.getpid()}
        raise KeyError(f"unknown rank verb {verb!r}")


# ---- HTTP between the leader and its ranks ---------------------------------------------------------

def _post_json(url: str, path: str, body: dict, timeout: float = RANK_TIMEOUT, connect_timeout: float = 3.0) -> tuple[int, Any]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=connect_timeout)
    try:
        conn.connect()
        conn.sock.settimeout(timeout)
        conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode("utf-8", "replace")
    finally:
        conn.close()
    return resp.status, (json.loads(text) if text.strip() else None)


def _get_json(url: str, path: str, timeout: float = 3.0) -> Any:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        text = resp.read().decode("utf-8", "replace")
    finally:
        conn.close()
    if resp.status != 200:
        raise EngineError(f"GET {url}{path}: HTTP {resp.status}: {text[:300]}")
    return json.loads(text) if text.strip() else None


class _RankHandler(BaseHTTPRequestHandler):
    rank: EngineRank

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        logger.debug(format, *args)

    def do_POST(self) -> None:
        verb = self.path.removeprefix("/p2pw_rank/")
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            status, payload = 200, {"ok": True, "result": self.rank.call(verb, body)}
        except Exception as e:  # noqa: BLE001 - reported to the leader
            logger.exception("rank %d: %s failed", self.rank.rank, verb)
            status, payload = 500, {"ok": False, "error": f"{type(e).__name__}: {e}"}
        send_json(self, status, payload)


def _rank_server(rank: EngineRank, host: str, port: int) -> ThreadingHTTPServer:
    handler = type("_BoundRankHandler", (_RankHandler,), {"rank": rank})
    httpd = ThreadingHTTPServer((host, port), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="p2pw-rank-control",
                     daemon=True).start()
    return httpd


# ---- the leader: the engine's ReceiverServer hooks --------------------------------------------------

class EngineHooks(ReceiverHooks):
    """The leader's hooks: the verbs run on rank 0 here and on every other rank over HTTP, at once."""

    def __init__(self, local: EngineRank, instance: str):
        self.local = local
        self.instance = instance
        self.world = local.engine.world_size
        self.rank_urls: dict[int, str] = {}
        self._lock = threading.Lock()

    # -- reading ---------------------------------------------------------------------------------
    def server_info(self) -> dict:
        info = dict(self.local.engine.args)
        info.update({
            "model_path": self.local.config,
            "served_model_name": self.local.name,
            "device": "cuda",  # the layout is a GPU rank's (the memory is host memory here)
            "remote_instance_weight_loader_start_seed_via_transfer_engine": self.local.transport == "mooncake",
            "internal_states": [{}],
            "p2pw_receiver": True,
            "p2pw_engine_name": self.local.name,
            "p2pw_transport": self.local.transport,
            "p2pw_instance": self.instance,
            "p2pw_ranks_ready": sorted([0, *self.rank_urls]),
        })
        return info

    def model_info(self) -> dict:
        from ..models.checkpoint import load_config

        cfg = load_config(self.local.config)
        return {"model_path": self.local.config, "tokenizer_path": None, "is_generation": True,
                "architectures": cfg.get("architectures"), "model_type": cfg.get("model_type")}

    def on_register_transfer_engine_info(self, rank: int, info: dict) -> None:
        url = info.get("p2pw_control_url")
        if url and rank != 0:
            with self._lock:
                self.rank_urls[int(rank)] = str(url)

    def get_weights_by_name(self, name: str, truncate_size: int) -> Any:
        return self.local.weights_by_name(name, truncate_size)

    # -- fan-out ----------------------------------------------------------------------------------
    def on_all(self, verb: str, body: dict | None = None) -> dict[int, Any]:
        """Run ``verb`` on every rank concurrently; raise one error naming every rank that failed."""
        body = body or {}
        with self._lock:
            urls = dict(self.rank_urls)
        missing = [r for r in range(1, self.world) if r not in urls]
        if missing:
            raise EngineError(f"engine {self.local.name}: rank(s) {missing} have not registered with the leader "
                              f"(still starting, or dead)")

        def remote(rank: int) -> Any:
            try:
                status, payload = _post_json(urls[rank], f"/p2pw_rank/{verb}", body)
            except OSError as e:
                raise EngineError(f"rank {rank} ({urls[rank]}) is unreachable: {e}") from e
            if status != 200 or not payload or not payload.get("ok"):
                raise EngineError(f"rank {rank}: {(payload or {}).get('error', f'HTTP {status}')}")
            return payload["result"]

        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        with ThreadPoolExecutor(max_workers=self.world, thread_name_prefix=f"p2pw-{verb}") as pool:
            futures = {0: pool.submit(self.local.call, verb, body)}
            futures.update({r: pool.submit(remote, r) for r in range(1, self.world)})
            for r, fut in futures.items():
                try:
                    results[r] = fut.result()
                except Exception as e:  # noqa: BLE001 - each rank's failure is named
                    errors[r] = f"{type(e).__name__}: {e}" if r == 0 else str(e)
        if errors:
            lines = "; ".join(f"rank {r}: {m}" for r, m in sorted(errors.items()))
            raise EngineError(f"engine {self.local.name}: {verb} failed on {len(errors)} rank(s): {lines}")
        return results

    # -- control verbs ------------------------------------------------------------------------------
    def on_begin_update(self, selector: str) -> None:
        self.on_all("begin", {"selector": selector})

    def on_end_update(self) -> None:
        self.on_all("end")

    def weights_checker(self, request: dict) -> dict:
        action = request.get("action")
        if action == "p2pw_compare":
            if request.get("hf_seed") is None:
                return {"success": False, "message": "action p2pw_compare needs hf_seed (the seed of "
                                                     "random_checkpoint the update was made from)"}
            ranks = self.on_all("compare", {"hf_seed": int(request["hf_seed"]),
                                            "skip": request.get("skip_tensor_list") or []})
            per_rank = [ranks[r] for r in sorted(ranks)]
            bad = [f"rank {r['rank']}: {m['name']}: {m['why']}" for r in per_rank for m in r["mismatches"]]
            compared = sum(r["compared"] for r in per_rank)
            if bad:
                shown = "; ".join(bad[:20]) + (f"; ... {len(bad) - 20} more" if len(bad) > 20 else "")
                message = f"engine {self.local.name}: {len(bad)} tensor(s) differ from sglang's loader: {shown}"
            else:
                message = (f"engine {self.local.name}: all {compared} tensors on {len(per_rank)} rank(s) equal "
                           f"sglang's loader (hf_seed {request['hf_seed']})")
            return {"success": not bad, "message": message, "ranks": per_rank, "mismatches": bad}
        if action == "checksum":
            ranks = self.on_all("checksum")
            sums = [ranks[r]["checksum"] for r in sorted(ranks)]
            return {"success": True, "message": "checksums of every parameter, buffer and derived tensor",
                    "ranks": sorted(ranks), "per_engine_checksum": sums}
        return {"success": False, "message": f"action {action!r} is not supported by this receiver "
                                             f"(p2pw_compare, checksum)"}

    def init_weights_update_group(self, request: dict) -> None:
        self.on_all("init_group", request)

    def update_weights_from_distributed(self, request: dict) -> None:
        self.on_all("update_from_distributed", request)

    def destroy_weights_update_group(self, group_name: str) -> None:
        self.on_all("destroy_group", {"group_name": group_name})


# ---- one rank process --------------------------------------------------------------------------------

def _print_ready(**fields: Any) -> None:
    # one write(2) of one short line: atomic even when forked ranks share the launcher's stdout pipe
    os.write(1, (json.dumps({"event": READY_EVENT, **fields}) + "\n").encode())


def _watch(check: Callable[[], bool], stop: threading.Event, interval: float = 0.5, misses: int = 4,
           why: str = "") -> None:
    """Set ``stop`` once ``check`` failed ``misses`` times in a row."""
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
               startup_timeout: float = 120.0) -> int:
    """The body of one rank process: build, register, publish, serve until told to stop."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if parent_pid:
        _watch(lambda: os.getppid() == parent_pid, stop, why=f"the parent process {parent_pid} is gone")

    er = EngineRank(config, engine, rank, transport=transport, name=name)
    peer, table, extra = er.published()
    closers: list[Callable[[], None]] = []
    try:
        if rank == 0:
            if leader:
                raise SystemExit("--leader is for ranks >= 1; rank 0 is the leader")
            instance = uuid.uuid4().hex
            server = ReceiverServer(EngineHooks(er, instance), host=host, port=port).start()
            closers.append(server.close)
            server.register_transfer_engine_info(0, peer, table, extra)
            url = control_url = server.url
        else:
            if not leader:
                raise SystemExit("ranks >= 1 need --leader URL (rank 0's URL)")
            httpd = _rank_server(er, host, port)
            closers.append(lambda: (httpd.shutdown(), httpd.server_close()))
            control_url = f"http://{host}:{httpd.server_address[1]}"
            deadline = time.monotonic() + startup_timeout
            while True:  # the leader may still be starting
                try:
                    instance = _get_json(leader, "/server_info")["p2pw_instance"]
                    register_transfer_engine_info(leader, rank, peer, table,
                                                  extra={**extra, "p2pw_control_url": control_url})
                    break
                except (OSError, EngineError, KeyError, ValueError) as e:
                    if time.monotonic() > deadline or stop.is_set():
                        raise SystemExit(f"rank {rank}: cannot register with the leader {leader}: {e}")
                    time.sleep(0.2)
            url = leader.rstrip("/")
            _watch(lambda: _get_json(leader, "/server_info", timeout=2.0).get("p2pw_instance") == instance, stop,
                   why=f"the leader {leader} is gone or was replaced")
        _print_ready(url=url, control_url=control_url, pid=os.getpid(), rank=rank, engine=name,
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


def run_launcher() -> int:
    """``--launcher``: import sglang once, then fork rank processes on request (a fork server).

    stdin: one JSON line per request ``{"op": "spawn", "id": N, "argv": [...], "log": PATH}``.
    stdout: ``{"event": "spawned", "id", "pid"}``, each rank's ready line, ``{"event": "exit", "pid",
    "code"}``. Exits (killing its ranks) when its parent goes away or stdin closes.
    """
    from ..replica import sglang_env

    sglang_env.prepare()                       # the slow part (seconds), done once
    parent = os.getppid()
    children: set[int] = set()
    lock = threading.Lock()

    def emit(**msg: Any) -> None:
        os.write(1, (json.dumps(msg) + "\n").encode())

    def shutdown() -> None:
        with lock:
            pids = list(children)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
            time.sleep(0.1)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(0)

    def reap() -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                time.sleep(0.2)
                continue
            with lock:
                children.discard(pid)
            emit(event="exit", pid=pid, code=os.waitstatus_to_exitcode(status))

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        shutdown()

    threading.Thread(target=reap, name="p2pw-launcher-reaper", daemon=True).start()
    threading.Thread(target=watch_parent, name="p2pw-launcher-parent", daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: shutdown())
    emit(event="launcher_ready", pid=os.getpid())
    for line in sys.stdin:
        try:
            req = json.loads(line)
        except ValueError:
            continue
        if req.get("op") != "spawn":
            continue
        with lock:
            pid = os.fork()
            if pid == 0:  # the rank process
                try:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(fd, 2)
                    os.close(fd)
                    null = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(null, 0)
                    os.close(null)
                    sys.stdin = open(os.devnull)
                    sys.stderr = os.fdopen(2, "w", buffering=1)
                    main(list(req["argv"]) + ["--parent-pid", str(os.getppid())])
                except BaseException:  # noqa: BLE001 - into the rank's log, then exit
                    import traceback

                    traceback.print_exc()
                    sys.stderr.flush()
                finally:
                    os._exit(1)
            children.add(pid)
        emit(event="spawned", id=req.get("id"), pid=pid)
    shutdown()
    return 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--launcher"]:
        os._exit(run_launcher())
    p = argparse.ArgumentParser(prog="python -m p2pweights.receiver.engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="directory with the model's config.json")
    p.add_argument("--engine", default="tp=1", help="tp=2[,ep=..,dp_attention=..,<server arg>=v]")
    p.add_argument("--rank", type=int, default=0, help="this process's engine rank (0 = the leader)")
    p.add_argument("--name", default="engine0", help="the engine's name (logs, errors)")
    p.add_argument("--transport", default=os.environ.get("P2PW_TRANSPORT", "mooncake"), choices=("mooncake", "nixl"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="rank 0: the engine's HTTP port; ranks >= 1: the rank's "
                                                       "control port (0: any free port)")
    p.add_argument("--leader", default=None, help="ranks >= 1: rank 0's URL")
    p.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer the parent")
    p.add_argument("--log-level", default=os.environ.get("P2PW_LOG_LEVEL", "WARNING"))
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"[%(asctime)s {args.name} rank {args.rank}] %(levelname)s %(name)s: %(message)s")
    code = serve_rank(args.model, args.engine, args.rank, name=args.name, transport=args.transport, host=args.host,
                      port=args.port, leader=args.leader, parent_pid=args.parent_pid)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: transports' destructors can hang at exit


# ---- starting engines from Python --------------------------------------------------------------------

def child_env(extra: dict | None = None) -> dict:
    """The environment of a rank process: this one's, the package importable, UCX set for loopback."""
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([pkg_root, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("UCX_MODULES", "^efa")           # NIXL segfaults at exit without it where rdma-core is
    try:
        has_rdma = bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        has_rdma = False
    if not has_rdma:
        env.setdefault("UCX_NET_DEVICES", "lo")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


class _ForkedRank:
    """A rank process forked by the launcher; the parts of ``subprocess.Popen`` LocalEngine uses."""

    def __init__(self, launcher: "_Launcher", pid: int):
        self.launcher, self.pid = launcher, pid
        self.stdout = None

    @property
    def returncode(self) -> int | None:
        return self.launcher.exit_codes.get(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        event = self.launcher.exited(self.pid)
        if not event.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Launcher:
    """The fork server (``--launcher``) of this process: sglang imported once, ranks forked from it,
    so an engine starts in about the time its model takes to build. One per process, started lazily."""

    _instance: "_Launcher | None" = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls, env: dict, log_dir: str) -> "_Launcher":
        with cls._instance_lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = cls(env, log_dir)
            return cls._instance

    def __init__(self, env: dict, log_dir: str):
        self.log_path = os.path.join(log_dir, "launcher.log")
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "p2pweights.receiver.engine", "--launcher"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
        log.close()
        self.exit_codes: dict[int, int] = {}
        self._exited: dict[int, threading.Event] = {}
        self._spawned: dict[int, Any] = {}
        self._ready_handlers: dict[int, Callable[[dict], None]] = {}
        self._pending_ready: dict[int, dict] = {}
        self._lock = threading.Lock()
        self._next = 0
        self._up = threading.Event()
        threading.Thread(target=self._read, name="p2pw-launcher-stdout", daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            event = msg.get("event") if isinstance(msg, dict) else None
            with self._lock:
                if event == "launcher_ready":
                    self._up.set()
                elif event == "spawned":
                    slot = self._spawned.get(msg["id"])
                    if slot is not None:
                        slot["pid"] = msg["pid"]
                        slot["event"].set()
                elif event == "exit":
                    self.exit_codes[msg["pid"]] = msg["code"]
                    self._exited.setdefault(msg["pid"], threading.Event()).set()
                    handler = self._ready_handlers.pop(msg["pid"], None)
                    if handler:
                        handler({})
                elif event == READY_EVENT:
                    handler = self._ready_handlers.pop(msg.get("pid"), None)
                    if handler:
                        handler(msg)
                    else:
                        self._pending_ready[msg.get("pid")] = msg
        with self._lock:  # the launcher died: so did every rank (they watch it)
            self._up.set()
            for ev in self._exited.values():
                ev.set()
            for slot in self._spawned.values():
                slot["event"].set()

    def exited(self, pid: int) -> threading.Event:
        with self._lock:
            return self._exited.setdefault(pid, threading.Event())

    def spawn(self, argv: list[str], log: str, on_ready: Callable[[dict], None], timeout: float) -> _ForkedRank:
        if not self._up.wait(timeout) or self.proc.poll() is not None:
            raise EngineError(f"the receiver launcher did not start; log {self.log_path}:\n{_tail(self.log_path)}")
        with self._lock:
            self._next += 1
            ident = self._next
            slot = self._spawned[ident] = {"event": threading.Event(), "pid": None}
        self.proc.stdin.write((json.dumps({"op": "spawn", "id": ident, "argv": argv, "log": log}) + "\n").encode())
        self.proc.stdin.flush()
        if not slot["event"].wait(timeout) or slot["pid"] is None:
            raise EngineError(f"the receiver launcher did not fork; log {self.log_path}:\n{_tail(self.log_path)}")
        pid = slot["pid"]
        with self._lock:
            del self._spawned[ident]
            early = self._pending_ready.pop(pid, None)
            if early is None and pid in self.exit_codes:
                early = {}
            if early is None:
                self._ready_handlers[pid] = on_ready
        if early is not None:
            on_ready(early)
        return _ForkedRank(self, pid)


class LocalEngine:
    """An engine of T rank processes on this host (``start_engine`` starts one): ``url``, ``pids``,
    ``kill(rank)``, ``restart()``, ``close()``. Restarts reuse the leader's port."""

    def __init__(self, model: str, engine: str = "tp=1", *, transport: str = "mooncake", name: str = "engine0",
                 host: str = "127.0.0.1", port: int = 0, env: dict | None = None, startup_timeout: float = 120.0,
                 log_dir: str | None = None, launch: str | None = None):
        from ..replica.layout import EngineLayout

        self.model = os.fspath(model)
        self.engine = engine
        self.world = EngineLayout.parse(engine).world_size
        self.transport = transport
        self.name = name
        self.host = host
        self.port = int(port)
        self.env = child_env(env)
        self.startup_timeout = startup_timeout
        self.log_dir = log_dir or tempfile.mkdtemp(prefix=f"p2pw-{name}-")
        self.launch = launch or os.environ.get("P2PW_RECEIVER_LAUNCH", "fork")
        if self.launch not in ("fork", "spawn"):
            raise ValueError(f"launch must be fork or spawn, got {self.launch!r} (P2PW_RECEIVER_LAUNCH)")
        self.procs: dict[int, Any] = {}
        self.ready: dict[int, dict] = {}
        self._ready_events: dict[int, threading.Event] = {}

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.procs.items()}

    def log_path(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"rank{rank}.log")

    def _spawn(self, rank: int) -> None:
        args = ["--model", self.model, "--engine", self.engine, "--rank", str(rank), "--name", self.name,
                "--transport", self.transport, "--host", self.host]
        if rank == 0:
            args += ["--port", str(self.port)]
        else:
            args += ["--leader", self.url]
        event = self._ready_events[rank] = threading.Event()
        self.ready.pop(rank, None)
        if self.launch == "fork":
            def on_ready(msg: dict, rank: int = rank) -> None:
                if msg:
                    self.ready[rank] = msg
                event.set()

            launcher = _Launcher.get(self.env, self.log_dir)
            self.procs[rank] = launcher.spawn(args, self.log_path(rank), on_ready, self.startup_timeout)
            return
        cmd = [sys.executable, "-m", "p2pweights.receiver.engine", *args, "--parent-pid", str(os.getpid())]
        log = open(self.log_path(rank), "ab")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=self.env)
        log.close()
        self.procs[rank] = proc

        def read() -> None:
            for line in proc.stdout:  # type: ignore[union-attr]
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if isinstance(msg, dict) and msg.get("event") == READY_EVENT:
                    self.ready[rank] = msg
                    event.set()
            event.set()  # EOF: the process ended
        threading.Thread(target=read, name=f"p2pw-{self.name}-rank{rank}-stdout", daemon=True).start()

    def start(self, wait: bool = True) -> "LocalEngine":
        """Spawn every rank at once (ranks >= 1 register with the leader when it is up)."""
        if self.port == 0:
            from ..baseline.broadcast import free_port

            self.port = free_port(self.host)
        for rank in range(self.world):
            self._spawn(rank)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float | None = None) -> "LocalEngine":
        deadline = time.monotonic() + (timeout or self.startup_timeout)
        for rank in range(self.world):
            event = self._ready_events[rank]
            if not event.wait(max(0.0, deadline - time.monotonic())) or rank not in self.ready:
                code = self.procs[rank].poll()
                state = f"exited with code {code}" if code is not None else "not ready in time"
                self.close()
                raise EngineError(f"engine {self.name} rank {rank} {state}; log {self.log_path(rank)}:\n"
                                  f"{_tail(self.log_path(rank))}")
        return self

    def kill(self, rank: int | None = None, sig: int = signal.SIGKILL) -> None:
        """Kill one rank process (``rank``) or all of them, and reap them."""
        for r in [rank] if rank is not None else list(self.procs):
            proc = self.procs.get(r)
            if proc is not None and proc.poll() is None:
                proc.send_signal(sig)
        for r in [rank] if rank is not None else list(self.procs):
            proc = self.procs.get(r)
            if proc is not None:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)

    def alive(self) -> dict[int, bool]:
        return {r: p.poll() is None for r, p in self.procs.items()}

    def restart(self, wait: bool = True) -> "LocalEngine":
        """Stop every rank still running, then start the engine again on the same port."""
        self.close()
        self.procs.clear()
        return self.start(wait=wait)

    def close(self, timeout: float = 10.0) -> None:
        """SIGTERM every rank (clean exit), SIGKILL what is left after ``timeout``."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
            if proc.stdout is not None:
                proc.stdout.close()

    def __enter__(self) -> "LocalEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LocalEngine({self.name!r}, {self.engine!r}, {self.transport}, url={self.url})"


def _tail(path: str, lines: int = 30) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def start_engine(model: str, engine: str = "tp=1", **kwargs: Any) -> LocalEngine:
    """Start an engine of T rank processes (T from ``engine``) and wait until every rank is ready."""
    return LocalEngine(model, engine, **kwargs).start()


def start_engines(model: str, engine: str = "tp=1", count: int = 1, *, name_prefix: str = "engine",
                  **kwargs: Any) -> list[LocalEngine]:
    """Start ``count`` engines at once (every rank process in parallel) and wait for all of them."""
    engines = [LocalEngine(model, engine, name=f"{name_prefix}{i}", **kwargs) for i in range(count)]
    try:
        for e in engines:
            e.start(wait=False)
        for e in engines:
            e.wait_ready()
    except BaseException:
        for e in engines:
            e.close()
        raise
    return engines


def check_weights_equal(url: str, hf_seed: int, skip: Sequence[str] = (), timeout: float = RANK_TIMEOUT) -> dict:
    """Ask an engine (its leader's URL) for the equality check after an update made from
    ``random_checkpoint(specs, hf_seed)``: ``POST /weights_checker {"action": "p2pw_compare",
    "hf_seed": N}``. Returns the answer (``success``, ``message``, ``ranks``, ``mismatches``)
    whether equal or not; raises EngineError only when the check could not run."""
    body: dict[str, Any] = {"action": "p2pw_compare", "hf_seed": int(hf_seed)}
    if skip:
        body["skip_tensor_list"] = list(skip)
    try:
        status, payload = _post_json(url, "/weights_checker", body, timeout=timeout)
    except OSError as e:
        raise EngineError(f"engine {url}: the equality check could not reach it: {e}") from e
    if status not in (200, 400) or not isinstance(payload, dict) or "success" not in payload:
        raise EngineError(f"engine {url}: the equality check failed: HTTP {status}: {str(payload)[:500]}")
    if status == 400 and "ranks" not in payload:
        raise EngineError(f"engine {url}: the equality check could not run: {payload.get('message')}")
    return payload


if __name__ == "__main__":
    sys.exit(main())
