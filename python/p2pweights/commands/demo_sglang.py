"""`p2pweights demo --engine-kind sglang`: the demo's steps against REAL sglang 0.5.23 servers.

Each engine is ``python -m sglang.launch_server`` on this host's CPU (the plugin's ``p2pw_cpu``
platform, dummy weights, ``sglang_plugin/cpu_server.py``) with the p2pweights plugin loaded, as any
server with p2pweights installed, and started with sglang's own
``--remote-instance-weight-loader-start-seed-via-transfer-engine``: each rank registers its weights
with sglang's Mooncake transfer engine (TCP on 127.0.0.1; the plugin's hook registers host memory)
and publishes them at the engine-info bootstrap server. The P2P senders are the demo's own (same
processes, same gloo group, same rows); they find the weights through sglang's proxy route.

The check after every step is sglang's own: ``/weights_checker`` (action ``checksum``: SHA-256 of
every parameter each rank holds) against the same checksums of what sglang's own ``load_weights``
makes of the step's HF tensors (``sglang_plugin/weight_checksums.py``).

Broadcast mode is sglang's own baseline: ``/init_weights_update_group`` (gloo; every rank of every
server joins the sender's group) and ``/update_weights_from_distributed``.

The transport is Mooncake: sglang 0.5.23 publishes a rank's weights only as a Mooncake session
(``RemoteInstanceWeightTransporter.init_engine``), so a NIXL sender has nothing to write into.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

from ..control import SglangEngine
from ..errors import UnsupportedLayout, WrongTransport
from ..models import load_config
from ..models.engine_layout import EngineLayout, parse_layout_spec
from ..sglang_plugin.cpu_server import CpuSglangServer, stop_servers
from ..sglang_plugin.weight_checksums import ExpectedChecksums, check_engine
from .demo_run import STEP_TIMEOUT, Checker, SenderPool, StepResult, run_broadcast, run_p2p

KIND = "sglang"
TRANSPORT = "mooncake"
# what a real sglang server publishes its weights with, and why nothing else can write into it
WHY_MOONCAKE = ("sglang's --remote-instance-weight-loader-start-seed-via-transfer-engine publishes each rank's "
                "weights as a Mooncake session only (sglang 0.5.23)")
# server args the demo's CPU servers take from --engine
HONOURED = frozenset({"tp_size"})
WHY_TP_ONLY = ("the demo's CPU sglang servers take tp=N only (dense TP ranks on the p2pw_cpu platform; EP, "
               "attention DP, PP and other server args were not run on it)")
START_TIMEOUT_S = 900.0  # a loaded 2-core host: each server's start-up can take minutes
# sglang 0.5.23 pads, on CPU ranks only (``adjust_config_with_unaligned_cpu_tp``), attention heads that
# tp does not divide and intermediate sizes that tp x 32 (its ``DEFAULT_MOE_PADDING_SIZE``) does not;
# a sender's replica is a GPU rank's, so it refuses such a server's publication (LayoutMismatch)
CPU_PADDING = 32
PADDED_SIZES = ("intermediate_size", "moe_intermediate_size", "intermediate_size_mlp", "shared_expert_intermediate_size")


def engine_layout(spec: str, config: Mapping[str, Any] | None = None) -> EngineLayout:
    """``--engine`` for this kind: ``tp=N`` only, every other key refused, and a tp whose CPU ranks
    sglang would pad for ``config`` (config.json's dict) refused too (one line, exit 2)."""
    layout = EngineLayout.from_args(parse_layout_spec(spec, command=f"demo --engine-kind {KIND}", honours=HONOURED,
                                                      why=WHY_TP_ONLY))
    why = cpu_padding(config or {}, layout.tp_size)
    if why:
        raise UnsupportedLayout(f"--engine tp={layout.tp_size}: {why}, so its ranks' shards are not a GPU rank's, "
                                f"which the senders' replica builds; choose a tp (or a model) without padding")
    return layout


def cpu_padding(config: Mapping[str, Any], tp: int) -> str | None:
    """What sglang pads in a CPU rank of ``tp`` ranks of this model, or None."""
    heads = config.get("num_attention_heads")
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", config.get("num_key_value_heads", heads))):
        if isinstance(value, int) and value % tp:
            return f"a CPU sglang rank pads {name} {value}, which tp={tp} does not divide"
    for name in PADDED_SIZES:
        value = config.get(name)
        if isinstance(value, int) and value % (tp * CPU_PADDING):
            return (f"a CPU sglang rank pads {name} {value} to a multiple of tp x {CPU_PADDING} = {tp * CPU_PADDING} "
                    f"(sglang's adjust_config_with_unaligned_cpu_tp)")
    return None


def pick_transport(name: str) -> tuple[str, str]:
    """(transport, why) for --transport (or P2PW_TRANSPORT) with real sglang servers: mooncake;
    nixl is refused (:class:`WrongTransport`, one line, exit 2), auto says why it is mooncake."""
    if name == "nixl":
        raise WrongTransport(f"--transport nixl: {WHY_MOONCAKE}, which a NIXL sender cannot write into; use "
                             f"--transport mooncake (or auto) with --engine-kind {KIND}")
    return TRANSPORT, f" (engine kind {KIND}: {WHY_MOONCAKE})" if name != TRANSPORT else ""


def _model_dir(model: str) -> str:
    """The folder sglang's ``--model-path`` takes (the demo also accepts a config.json's path)."""
    return model if os.path.isdir(model) else os.path.dirname(os.path.abspath(model))


class _Prepared:
    """``ExpectedChecksums.prepare`` on a thread (the references build while the servers start and the
    senders connect; the coordinator only waits then); :meth:`wait` re-raises what it raised."""

    def __init__(self, expected: ExpectedChecksums):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(expected,), name="p2pw-demo-references", daemon=True)
        self.thread.start()

    def _run(self, expected: ExpectedChecksums) -> None:
        try:
            expected.prepare()
        except BaseException as e:  # noqa: BLE001 (re-raised by wait, in the coordinator's thread)
            self.error = e

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def checksum_checker(expected: ExpectedChecksums, servers: Sequence[CpuSglangServer],
                     progress: Callable[[str], None], verbose: bool = False,
                     prepared: _Prepared | None = None) -> Checker:
    """The steps' check: sglang's own checksums of every rank of every server against sglang's loader
    of the step's checkpoint (one reference per rank, reloaded per step)."""
    clients = [SglangEngine(s.url, name=s.name, timeout=STEP_TIMEOUT) for s in servers]

    def check(seed: int, changed: tuple[float, int] | None) -> tuple[bool, str]:
        t0 = time.perf_counter()
        if prepared is not None:
            prepared.wait()
        want = expected.of(seed, changed)
        t1 = time.perf_counter()
        results = [check_engine(c, want) for c in clients]
        if verbose:
            progress(f"    check: expected checksums of {len(want)} rank(s) in {t1 - t0:.1f} s, sglang's "
                     f"/weights_checker of {len(clients)} server(s) in {time.perf_counter() - t1:.1f} s")
        bad = [why for equal, why in results if not equal]
        return not bad, "; ".join(bad)

    return check


@contextlib.contextmanager
def _sigterm_exits() -> Iterator[None]:
    """SIGTERM (``timeout``, a job runner) raises SystemExit here, so the servers, which run in process
    groups of their own, are stopped on the way out instead of outliving the demo."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_sglang_demo(model: str, *, engines: int = 1, engine: str = "tp=1", senders: int = 1, steps: int = 2,
                    transport: str = TRANSPORT, modes: Sequence[str] = ("p2p", "broadcast"), check: bool = True,
                    overrides: dict | None = None, progress: Callable[[str], None] = print, verbose: bool = False,
                    verify: str = "off", changed_fraction: float | None = None) -> list[StepResult]:
    """The demo's modes against ``engines`` real CPU sglang servers of layout ``engine`` (``tp=N``);
    ``transport``: mooncake (or auto), nixl is refused (:func:`pick_transport`)."""
    layout = engine_layout(engine, load_config(model))
    pick_transport(transport)
    overrides = overrides or {}
    model_dir = _model_dir(model)
    log_dir = tempfile.mkdtemp(prefix="p2pw-demo-sglang-")
    t0 = time.perf_counter()
    progress(f"starting {engines} real sglang server(s) x tp={layout.tp_size} on the CPU (p2pw_cpu platform, "
             f"p2pweights plugin, weights published over Mooncake TCP on 127.0.0.1; logs in {log_dir}) ...")
    servers: list[CpuSglangServer] = []
    pool = None
    results: list[StepResult] = []
    with _sigterm_exits():
        try:
            for i in range(engines):
                servers.append(CpuSglangServer.start(model_dir, os.path.join(log_dir, f"engine{i}.log"),
                                                     tp=layout.tp_size, seed_via_mooncake=True, name=f"engine{i}"))
            if "p2p" in modes:  # the senders import sglang and build their replicas while the servers start
                pool = SenderPool(model, senders, {"transport": TRANSPORT, **overrides},
                                  None if verbose else log_dir, timeout=STEP_TIMEOUT)
            expected = ExpectedChecksums(model, layout)
            prepared = _Prepared(expected) if check else None  # and so do the check's references
            for server in servers:
                server.wait_healthy(timeout=START_TIMEOUT_S)
            progress(f"servers healthy in {time.perf_counter() - t0:.1f} s: "
                     + ", ".join(f"{s.name} {s.url} ({s.healthy_after_s:.0f} s)" for s in servers))
            checker = checksum_checker(expected, servers, progress, verbose, prepared) if check else None
            if "p2p" in modes:
                started, pool = pool, None  # run_p2p closes it
                results += run_p2p(model, servers, senders=senders, steps=steps, transport=TRANSPORT, check=check,
                                   overrides=overrides, progress=progress, pool=started, verbose=verbose,
                                   verify=verify, changed_fraction=changed_fraction, checker=checker)
            if "broadcast" in modes:
                results += run_broadcast(model, servers, steps=steps, check=check, progress=progress,
                                         changed_fraction=changed_fraction, checker=checker)
        finally:
            if pool is not None:
                pool.close()
            stop_servers(servers)
    return results
