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
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from ..control import SglangEngine, UpdateSession, call_engines
from ..errors import EngineError
from ..settings import REGISTRY
from ..settings import value as setting

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

DEFAULT_GROUP = "p2pw_broadcast"
DEFAULT_BUCKET_BYTES = REGISTRY["P2PW_BROADCAST_BUCKET"].default
DEFAULT_TIMEOUT = 120.0


def group_store(store: Any, group_name: str, backend: str) -> Any:
    """``store`` as a real sglang rank's update group sees it, so that both ends meet on the same keys:
    sglang's ``init_custom_process_group`` wraps the rendezvous store in ``PrefixStore(group_name)``,
    and torch's process-group helper it calls wraps that in ``"{group_name}/"`` and then in the
    device of the backend's first device (``"cpu/"`` for gloo, ``"cuda/"`` for nccl), as every
    process group torch makes. A single ``PrefixStore(group_name)`` left a sender waiting for a real
    server's ranks until the group's timeout."""
    import torch.distributed as dist

    device = "cpu" if backend == "gloo" else "cuda"
    return dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store)))


class WeightUpdateGroup:
    """One member of a torch.distributed group of its own (not the default group: the trainer has
    one, the engine may too), as sglang's ``init_custom_process_group`` makes, from public APIs
    only: group rank 0 hosts a ``TCPStore`` at ``master_address:master_port`` (or passes its own
    ``store``), every member wraps it in the ``PrefixStore``s a real sglang rank's group reads its
    keys through (:func:`group_store`) and builds the backend's process group on it
    (``ProcessGroupGloo`` / ``ProcessGroupNCCL``). The group is not registered in torch.distributed's
    global state, so its collectives are its own methods."""

    def __init__(self, backend: str, master_address: str, master_port: int, world_size: int, rank: int,
                 group_name: str, timeout: float = DEFAULT_TIMEOUT, store: Any = None):
        import torch.distributed as dist

        td = datetime.timedelta(seconds=float(timeout))
        self.backend, self.rank, self.world_size, self.group_name = backend, int(rank), int(world_size), group_name
        if store is None:
            store = dist.TCPStore(master_address, int(master_port), self.world_size, is_master=self.rank == 0,
                                  timeout=td, wait_for_workers=False, multi_tenant=True)
        self.store = store
        prefixed = group_store(store, group_name, backend)
        if backend == "gloo":
            self.pg = dist.ProcessGroupGloo(prefixed, self.rank, self.world_size, td)
        elif backend == "nccl":
            if not hasattr(dist, "ProcessGroupNCCL"):
                raise EngineError("backend nccl needs a CUDA build of torch; use backend='gloo'")
            self.pg = dist.ProcessGroupNCCL(prefixed, self.rank, self.world_size, td)
        else:
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")

    def broadcast(self, tensor: "torch.Tensor") -> None:
        """Group rank 0 sends ``tensor``; every other member receives into it (in place)."""
        self.pg.broadcast(tensor, 0).wait()

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            pg.shutdown()
        self.store = None


class GroupReceiver:
    """The engine-rank side of the broadcast path: a ``p2pweights.receiver.rank.BroadcastReceiver``
    (the rank processes' default ``--broadcast-receiver``)."""

    def join(self, backend: str, master_address: str, master_port: int, world_size: int, rank: int,
             group_name: str, timeout: float = DEFAULT_TIMEOUT) -> WeightUpdateGroup:
        return WeightUpdateGroup(backend, master_address, master_port, world_size, rank, group_name, timeout)

    def receive(self, group: WeightUpdateGroup, tensor: "torch.Tensor") -> None:
        group.broadcast(tensor)

    def leave(self, group: WeightUpdateGroup) -> None:
        group.close()


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
    listens (this process hosts it; port default: any free one, read ``master_port`` after
    ``init_group``).
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
        self.master_port = int(master_port) if master_port else 0
        self.group_name = group_name
        self.bucket_bytes = int(setting("P2PW_BROADCAST_BUCKET", bucket_bytes))
        self.timeout = float(timeout)
        self.flush_cache = flush_cache
        self.group: WeightUpdateGroup | None = None
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
        import torch.distributed as dist

        # this process hosts the group's store, so the engines can be told its port before anyone joins
        td = datetime.timedelta(seconds=self.timeout)
        store = dist.TCPStore(self.master_address, self.master_port, self.world_size, is_master=True, timeout=td,
                              wait_for_workers=False, multi_tenant=True)
        self.master_port = store.port
        calls: dict[str, Any] = {}

        def ask() -> None:
            calls["result"] = call_engines(
                self.engines, lambda e: e.init_weights_update_group(self.master_address, self.master_port,
                                                                    offsets[e.name], self.world_size,
                                                                    self.group_name, self.backend))

        t = threading.Thread(target=ask, name="p2pw-broadcast-init", daemon=True)
        t.start()
        try:
            self.group = WeightUpdateGroup(self.backend, self.master_address, self.master_port, self.world_size, 0,
                                           self.group_name, self.timeout, store=store)
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
            group.close()
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
        if self.group is None:
            raise EngineError("the broadcast group is not initialized: call init_group() (or update()) first")
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
                self.group.broadcast(tensor.detach().to(self.device).contiguous())
        finally:
            t.join(self.timeout + 10)
        result = calls.get("result")
        if result is None:
            raise EngineError(f"update_weights_from_distributed did not answer within {self.timeout + 10:g}s")
        result.raise_for_errors()
