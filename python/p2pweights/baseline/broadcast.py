"""The broadcast baseline: what RL frameworks run today, through sglang's own routes.

One sender per PP stage is rank 0 of a torch.distributed group that every engine rank of every
engine joins (gloo on CPU, NCCL on GPU). Per bucket of full HF tensors the sender asks every
engine, concurrently, to ``POST /update_weights_from_distributed {names, dtypes, shapes,
group_name}`` and meanwhile broadcasts each tensor of the bucket from rank 0; each engine rank
receives every tensor whole and loads it with its own sglang loader. sglang 0.5.23 runs this only
inside a weight-update session, so one update is::

    pause_generation -> begin_weight_update -> (buckets) -> end_weight_update
        -> update_weight_version -> continue_generation

Usage (trainer side)::

    sender = BroadcastSender([engine0_url, engine1_url], backend="gloo")
    sender.init_group()                       # POST /init_weights_update_group on every engine + join
    report = sender.update(named_tensors, version=step)   # report.seconds: pause returned -> update returned
    sender.close()                            # POST /destroy_weights_update_group, leave the group

Works against real sglang servers and p2pweights receivers alike (same routes, same bodies).
"""
from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from ..settings import parse_size
from ..control.sglang import SglangEngine, UpdateSession, call_engines
from ..errors import EngineError

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_GROUP = "p2pw_broadcast"
DEFAULT_BUCKET_BYTES = 256 << 20
DEFAULT_TIMEOUT = 120.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join_weight_update_group(backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                             group_name: str, timeout: float = DEFAULT_TIMEOUT) -> Any:
    """Join a torch.distributed group of its own (not the default group: the trainer has one, the
    engine may too), as sglang's ``init_custom_process_group`` does; rank 0 hosts the TCP store.
    Returns the process group; ``broadcast(t, src=0, group=pg)`` works in it."""
    from torch.distributed import distributed_c10d as c10d

    td = datetime.timedelta(seconds=float(timeout))
    store, rank, world_size = next(c10d.rendezvous(f"tcp://{master_address}:{int(master_port)}", int(rank),
                                                   int(world_size), timeout=td))
    store.set_timeout(td)
    store = c10d.PrefixStore(group_name, store)
    pg, _ = c10d._new_process_group_helper(world_size, rank, [], c10d.Backend(backend), store,
                                           group_name=group_name, timeout=td)
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def leave_weight_update_group(pg: Any) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(pg)


def dtype_name(t: "torch.Tensor") -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass
class BroadcastReport:
    """One broadcast update: seconds from pause returning to the update returning."""

    version: str
    seconds: float
    bytes: int               # bytes the sender broadcast (each reaches every engine rank)
    tensors: int
    buckets: int
    engines: list[str] = field(default_factory=list)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class BroadcastSender:
    """Rank 0 of one weight-update group spanning every rank of ``engines`` (one PP stage).

    ``engines``: SglangEngine objects or URLs. ``backend``: gloo (CPU tensors) or nccl (CUDA);
    default nccl when CUDA is available, else gloo. ``bucket_bytes`` (``P2PW_BROADCAST_BUCKET``):
    tensors per ``update_weights_from_distributed`` call, by size. ``timeout``: the group's
    collective timeout, seconds. ``master_address``/``master_port``: where the group's store
    listens (this process; port default: a free one).
    """

    def __init__(self, engines: Sequence[SglangEngine | str], *, backend: str | None = None,
                 master_address: str = "127.0.0.1", master_port: int | None = None,
                 group_name: str = DEFAULT_GROUP, bucket_bytes: int | str | None = None,
                 timeout: float = DEFAULT_TIMEOUT, flush_cache: bool = True):
        import torch

        self.engines = [e if isinstance(e, SglangEngine) else SglangEngine(e, name=f"engine{i}")
                        for i, e in enumerate(engines)]
        if not self.engines:
            raise ValueError("BroadcastSender needs at least one engine")
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = "cpu" if self.backend == "gloo" else "cuda"
        self.master_address = master_address
        self.master_port = int(master_port) if master_port else free_port(master_address)
        self.group_name = group_name
        raw = bucket_bytes if bucket_bytes is not None else os.environ.get("P2PW_BROADCAST_BUCKET")
        self.bucket_bytes = parse_size(raw) if raw is not None else DEFAULT_BUCKET_BYTES
        self.timeout = float(timeout)
        self.flush_cache = flush_cache
        self.group: Any = None
        self.engine_ranks: dict[str, int] = {}
        self.world_size = 0

    # -- the group ---------------------------------------------------------------------------------
    def init_group(self) -> None:
        """Ask every engine to join (``POST /init_weights_update_group``, rank offsets after the
        sender's rank 0, world size 1 + every engine rank) while this process joins as rank 0."""
        if self.group is not None:
            return
        for e in self.engines:
            info = e.server_info()
            self.engine_ranks[e.name] = int(info.get("tp_size", 1)) * int(info.get("pp_size", 1))
        self.world_size = 1 + sum(self.engine_ranks.values())
        offsets, offset = {}, 1
        for e in self.engines:
            offsets[e.name] = offset
            offset += self.engine_ranks[e.name]
        calls: dict[str, Any] = {}

        def ask() -> None:
            calls["result"] = call_engines(
                self.engines, lambda e: e.init_weights_update_group(self.master_address, self.master_port,
                                                                    offsets[e.name], self.world_size,
                                                                    self.group_name, self.backend))

        t = threading.Thread(target=ask, name="p2pw-broadcast-init", daemon=True)
        t.start()
        try:
            self.group = join_weight_update_group(self.backend, self.master_address, self.master_port,
                                                  self.world_size, 0, self.group_name, self.timeout)
        finally:
            t.join(self.timeout + 10)
        result = calls.get("result")
        if result is None:
            raise EngineError("init_weights_update_group did not answer on every engine")
        result.raise_for_errors()

    def close(self) -> None:
        """Every engine leaves the group, then this process. Idempotent; never raises for engines."""
        if self.group is None:
            return
        group, self.group = self.group, None
        calls = call_engines(self.engines, "destroy_weights_update_group", self.group_name)
        for name, err in calls.errors.items():
            logger.warning("engine %s: destroy_weights_update_group failed: %s", name, err)
        try:
            leave_weight_update_group(group)
        except Exception as e:  # noqa: BLE001
            logger.warning("leaving the broadcast group failed: %s", e)

    def __enter__(self) -> "BroadcastSender":
        self.init_group()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- one update --------------------------------------------------------------------------------
    def update(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]], version: str | int) -> BroadcastReport:
        """One whole update: pause, begin, every bucket, end, bump ``version``, continue.
        ``seconds`` runs from pause returning to this call returning."""
        if self.group is None:
            self.init_group()
        with UpdateSession(self.engines, version) as session:
            nbytes, tensors, buckets = self.push(named_tensors)
        return BroadcastReport(version=str(version), seconds=time.perf_counter() - session.paused_at, bytes=nbytes,
                               tensors=tensors, buckets=buckets, engines=[e.name for e in self.engines])

    def push(self, named_tensors: Iterable[tuple[str, "torch.Tensor"]]) -> tuple[int, int, int]:
        """Broadcast the tensors in buckets (inside an open weight-update session); returns
        (bytes, tensors, buckets)."""
        bucket: list[tuple[str, Any]] = []
        size = nbytes = tensors = buckets = 0
        for name, t in named_tensors:
            n = t.numel() * t.element_size()
            if bucket and size + n > self.bucket_bytes:
                self.broadcast_bucket(bucket)
                buckets += 1
                bucket, size = [], 0
            bucket.append((name, t))
            size += n
            nbytes += n
            tensors += 1
        if bucket:
            self.broadcast_bucket(bucket)
            buckets += 1
        return nbytes, tensors, buckets

    def broadcast_bucket(self, bucket: Sequence[tuple[str, "torch.Tensor"]]) -> None:
        """One ``update_weights_from_distributed`` call on every engine (each in a thread) while
        this process broadcasts each tensor of the bucket, in order, from rank 0."""
        import torch.distributed as dist

        names = [n for n, _ in bucket]
        dtypes = [dtype_name(t) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        calls: dict[str, Any] = {}

        def ask() -> None:
            calls["result"] = call_engines(
                self.engines, lambda e: e.update_weights_from_distributed(names, dtypes, shapes, self.group_name,
                                                                          flush_cache=self.flush_cache))

        t = threading.Thread(target=ask, name="p2pw-broadcast-bucket", daemon=True)
        t.start()
        try:
            for _, tensor in bucket:
                dist.broadcast(tensor.detach().to(self.device).contiguous(), src=0, group=self.group)
        finally:
            t.join(self.timeout + 10)
        result = calls.get("result")
        if result is None:
            raise EngineError(f"update_weights_from_distributed did not answer within {self.timeout + 10:g}s")
        result.raise_for_errors()
