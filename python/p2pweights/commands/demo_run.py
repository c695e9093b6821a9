"""The demo, the main job: engines and senders on one machine, K updates with P2P and broadcast.

E engines of T ranks each run as receiver processes (real sglang model classes of their ranks, real
Mooncake or NIXL registration). S sender processes each run a WeightSender (the planner picks the
engine ranks each one prepares) and join one gloo process group, as a trainer's ranks do: sender 0
of the group pauses the engines, opens and ends their session, bumps the version and continues
them; every sender writes. Per step: every sender makes the step's full HF tensors (random
weights, outside the timed part), then on "go" runs ``sender.update(version)`` with control;
seconds are sender 0's ``report.seconds`` (pause_generation returning to the update returning, as
the broadcast baseline measures). Then every engine rank checks, byte for byte, that its weights
equal what sglang's own load_weights makes of the same HF tensors.

An FP8 block-quantized model (``deepseek-v3-fp8-tiny``): the P2P senders push the BF16 tensors a
trainer holds (``trainer_tensors``) and quantize on send; the broadcast baseline sends the engine's
checkpoint (FP8 weights + scales, quantized from the same seeded BF16). The equality check compares
with sglang's loader on that FP8 checkpoint.

``changed_fraction`` F (``--changed-fraction``): instead of a fresh seed per step, step k of each
mode pushes version k of the run's changed family (``models.checkpoint``: each version differs from
the previous one in a fraction F of the elements, uniformly spread), and the check asks for the same
version. After the first update the engines take only the changed bytes, as delta records
(docs/deltas.md); the rows show the bytes that crossed the transport next to a full update's.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import wait as mp_wait
from typing import Any, Callable, Sequence

from ..settings import format_size

STEP_TIMEOUT = 600.0  # seconds a sender may take to answer a step; also its group's collective timeout
# Before the second step and later, at most this long each sender waits for the copy plans its
# background recorder is making (copyplans/background_recorder.py): in a real run the trainer's
# rollout and training step give it that time; the demo's steps follow each other at once
PLANS_WAIT_S = 120.0


@dataclass
class StepResult:
    mode: str          # "p2p" | "broadcast"
    transport: str     # mooncake | nixl | gloo | nccl
    step: int
    seconds: float     # pause returned -> update returned (P2P: sender 0's report.seconds)
    bytes: int         # bytes per engine rank (the largest)
    gbps: float
    equal: bool | None  # None when the check was skipped
    detail: str = ""
    # P2P only, the slowest sender's split of its part of the step (see UpdateReport):
    loading_seconds: float = 0.0  # the replica's loaders filling slots
    waiting_seconds: float = 0.0  # blocked on a free slot or on the last writes
    verified: bool = False        # update(verify=True): engine ranks digested what they hold (--verify)
    verify_seconds: float = 0.0   # the slowest sender's verification, part of ``seconds``
    # P2P only, per sender process: CPU seconds of its update (UpdateReport.cpu_seconds: all its
    # threads) and of it the thread that ran update() (loaders, staging; the rest is native writes)
    sender_cpu_seconds: list[float] = field(default_factory=list)
    sender_caller_cpu_seconds: list[float | None] = field(default_factory=list)
    # what crossed the transport per engine rank (the largest; delta records included): P2P's
    # report.bytes_written, else ``bytes``; and why engine ranks got a full write (P2P, deltas)
    bytes_written: int | None = None  # None: ``bytes``
    delta_reason: str = ""

    def __post_init__(self) -> None:
        if self.bytes_written is None:
            self.bytes_written = self.bytes

    @property
    def label(self) -> str:
        return self.mode + ("+verify" if self.verified else "")

    @property
    def outside_fraction(self) -> float:
        """Share of the step spent neither loading nor waiting for writes (control plane, staging,
        checks, Python): the pipeline's own overhead."""
        if self.mode != "p2p" or self.seconds <= 0:
            return 0.0
        return max(0.0, self.seconds - self.loading_seconds - self.waiting_seconds) / self.seconds


# -- sender processes ------------------------------------------------------------------------------
def _sender_main(conn: Any, model: str, index: int, count: int, port: int, overrides: dict, log_path: str | None,
                 timeout: float) -> None:
    """A sender process, as a trainer rank: join the senders' gloo group, wait for the engines,
    connect once, then per step make the tensors, wait for "go", run the update (sender 0 of the
    group controls the engines' session), report."""
    if log_path:
        # The transports' native logs (Mooncake's glog) go to a file, not over the demo's rows;
        # failures still reach the coordinator through the pipe, with the traceback.
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        import datetime

        import torch.distributed as dist

        from ..models.checkpoint import random_checkpoint
        from ..sender.weight_sender import WeightSender

        # the group's collectives time out with the coordinator's step: a sender that died fails the others
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=index, world_size=count,
                                timeout=datetime.timedelta(seconds=timeout))
        sender = WeightSender(model, group=dist.group.WORLD, **overrides)
        _, engines = conn.recv()  # ("connect", [{"url", "name", "kind", "api_key"}, ...])
        sender.connect([engine_client(**e) for e in engines])
        specs = _trainer_specs(sender)
        conn.send(("connected", None))
        while True:
            cmd, arg = conn.recv()
            if cmd == "close":
                break
            if cmd == "prepare":
                seed, changed, plans_wait = arg
                tensors = list(random_checkpoint(specs, seed=seed, changed=changed))
                t0 = time.perf_counter()
                if plans_wait and sender.recorder is not None:
                    sender.recorder.wait(plans_wait)
                conn.send(("ready", time.perf_counter() - t0))
            elif cmd == "go":
                version, verify = arg
                try:
                    with sender.update(version, verify=verify) as update:
                        update.push_many(tensors)  # the bulk path (sender/bulk_push.py), as a trainer would
                    conn.send(("done", _step_answer(update)))
                except Exception as e:  # noqa: BLE001 - reported to the coordinator, which fails the step
                    conn.send(("failed", f"sender {index}: {type(e).__name__}: {e}"))
                tensors = None
        sender.close()
        dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def engine_client(url: str, name: str, kind: str = "sglang", api_key: str | None = None) -> Any:
    """A sender's control-plane client of one engine: sglang's (receivers, sglang servers) or vLLM's."""
    from ..control import SglangEngine, VllmEngine

    if kind == "vllm":
        return VllmEngine(url, name=name, api_key=api_key)
    return SglangEngine(url, name=name, api_key=api_key)


def _step_answer(update: Any) -> dict:
    """What a sender tells the coordinator of its finished update (sender 0's ``seconds`` is the step's)."""
    r = update.report
    reasons = r.delta_reason  # engine rank -> why it got a full write
    text = str(r)
    if r.control:  # sender 0: where its control plane went (--verbose)
        verbs = ", ".join(f"{n} {s:.3f} s" for n, s in r.control.items())
        text += (f"\n  before the pause {r.validate_seconds:.3f} s; pause + begin {r.pause_seconds:.3f} s; "
                 f"control {r.control_seconds:.3f} s ({verbs})")
    return {"seconds": r.seconds, "bytes_max": max((e.bytes for e in r.engines), default=0),
            "written_max": max((e.bytes_written for e in r.engines), default=0),
            "reasons": sorted({v for v in reasons.values() if v}),
            "loading": r.loading_seconds, "waiting": r.waiting_seconds, "verify": update.verify_seconds,
            "report": text, "cpu": r.cpu_seconds, "caller_cpu": r.caller_cpu_seconds}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _trainer_specs(sender: Any) -> dict:
    """The HF tensors the sender's engine ranks read, as a trainer holds them: for an FP8 model
    BF16 weights and no ``weight_scale_inv`` (the sender quantizes on send); else the checkpoint's."""
    from ..models.checkpoint import trainer_tensors
    from ..models.quant import weight_name

    trainer = trainer_tensors(sender.config)
    specs = {}
    for p in sender.prepared:
        for name, spec in p.replica.hf_specs.items():
            if name in trainer:
                specs[name] = trainer[name]
            elif weight_name(name) not in trainer:  # a scale is made on send, never pushed
                specs[name] = spec
    return specs


class SenderPool:
    """S sender processes in one gloo group, driven in lock step by the coordinator.

    The senders fork from a forkserver that imported sglang once (``p2pweights.replica.preload``),
    so each skips the ~10 s import; the server starts at once, while the engines start.
    ``timeout``: the group's collective timeout, seconds (a sender that died fails the others).
    """

    def __init__(self, model: str, count: int, overrides: dict, log_dir: str | None = None,
                 timeout: float = STEP_TIMEOUT):
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["p2pweights.replica.preload"])
        self.conns, self.procs = [], []
        self.log_dir = log_dir
        port = _free_port()  # the group's rendezvous (sender 0 listens on it)
        for i in range(count):
            parent, child = ctx.Pipe()
            log = os.path.join(log_dir, f"sender{i}.log") if log_dir else None
            p = ctx.Process(target=_sender_main, args=(child, model, i, count, port, overrides, log, timeout),
                            name=f"p2pw-sender-{i}", daemon=True)
            p.start()
            self.conns.append(parent)
            self.procs.append(p)

    def connect(self, urls: Sequence[str], names: Sequence[str], timeout: float = STEP_TIMEOUT,
                kinds: Sequence[str] | None = None, api_keys: Sequence[str | None] | None = None) -> None:
        """``kinds``/``api_keys``: per engine, its client (:func:`engine_client`; default sglang, no key)."""
        kinds = kinds or ["sglang"] * len(urls)
        api_keys = api_keys or [None] * len(urls)
        self._tell("connect", [{"url": u, "name": n, "kind": k, "api_key": a}
                               for u, n, k, a in zip(urls, names, kinds, api_keys)])
        self._expect("connected", timeout=timeout)

    def _where(self, i: int) -> str:
        return f" (its log: {self.log_dir}/sender{i}.log)" if self.log_dir else ""

    def _tell(self, cmd: str, arg: Any) -> None:
        for i, c in enumerate(self.conns):
            try:
                c.send((cmd, arg))
            except (BrokenPipeError, ConnectionResetError):
                raise RuntimeError(f"sender {i} exited (before {cmd!r} reached it){self._where(i)}") from None

    def _expect(self, what: str, timeout: float) -> list[Any]:
        """Every sender's answer, in sender order; the first sender that failed or exited raises at
        once (the others may be waiting for it in a collective of the group)."""
        answers: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        while len(answers) < len(self.conns):
            pending = [c for i, c in enumerate(self.conns) if i not in answers]
            ready = mp_wait(pending, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = [i for i in range(len(self.conns)) if i not in answers]
                raise TimeoutError(f"sender(s) {', '.join(map(str, late))} did not answer {what!r} within "
                                   f"{timeout:.0f} s")
            for c in ready:
                i = self.conns.index(c)
                try:
                    kind, payload = c.recv()
                except EOFError:
                    raise RuntimeError(f"sender {i} exited (before answering {what!r}){self._where(i)}") from None
                if kind == "error":
                    raise RuntimeError(f"sender {i} failed{self._where(i)}:\n{payload}")
                answers[i] = (kind, payload)
        return [answers[i] for i in range(len(self.conns))]

    def prepare(self, seed: int, changed: tuple[float, int] | None = None, plans_wait: float = 0.0) -> float:
        """Each sender makes ``random_checkpoint(specs, seed, changed=changed)``, then waits up to
        ``plans_wait`` seconds for its background copy-plan recorder to finish; the longest wait."""
        self._tell("prepare", (seed, changed, plans_wait))
        return max(waited for _, waited in self._expect("ready", timeout=STEP_TIMEOUT + plans_wait))

    def go(self, version: str, timeout: float, verify: bool = False) -> list[tuple[str, Any]]:
        self._tell("go", (version, verify))
        return self._expect("done", timeout=timeout)

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("close", None))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


# -- the two modes ---------------------------------------------------------------------------------
def _version(step: int, seed_base: int, changed_fraction: float | None) -> tuple[int, tuple[float, int] | None]:
    """(seed, changed) of a step's checkpoint: a fresh seed per step, or version ``step`` of the
    run's changed family (one base seed per run)."""
    if changed_fraction is None:
        return seed_base + step, None
    return seed_base, (changed_fraction, step)


# (seed, changed) of the step's checkpoint -> (equal, why not): how the engines' bytes are checked
# when they are not p2pweights receivers (their ``p2pw_compare``), as real sglang servers are
Checker = Callable[[int, "tuple[float, int] | None"], "tuple[bool | None, str]"]


def _check(engines: Sequence[Any], seed: int, enabled: bool, changed: tuple[float, int] | None = None,
           checker: Checker | None = None) -> tuple[bool | None, str]:
    if not enabled:
        return None, ""
    if checker is not None:
        return checker(seed, changed)
    from ..receiver import check_weights_equal

    version = {"changed_fraction": changed[0], "changed_steps": changed[1]} if changed else {}
    results = [check_weights_equal(e.url, hf_seed=seed, **version) for e in engines]
    bad = [r["message"] for r in results if not r.get("success")]
    return not bad, "; ".join(bad)


def run_p2p(model: str, engines: Sequence[Any], *, senders: int, steps: int, transport: str, check: bool,
            overrides: dict, progress: Callable[[str], None], seed_base: int = 0, timeout: float = STEP_TIMEOUT,
            pool: "SenderPool | None" = None, verbose: bool = False, verify: str = "off",
            changed_fraction: float | None = None, checker: Checker | None = None) -> list[StepResult]:
    """verify: "off", "on" (every step verified), "alternate" (even steps verified: its cost, same run).
    changed_fraction: step k pushes version k of the changed family of ``seed_base`` (None: fresh seeds).
    checker: how each step is checked (default: the receivers' ``p2pw_compare``).
    Sender 0 of the pool's group controls each step's session; its report times the step."""
    t0 = time.perf_counter()
    if pool is None:
        pool = SenderPool(model, senders, {"transport": transport, **overrides}, timeout=timeout)
    progress(f"p2p: {senders} sender process(es) ({transport}) in one gloo group build their replicas and connect")
    # an engine object may name its client kind and key (the vLLM demo's engines do)
    pool.connect([e.url for e in engines], [e.name for e in engines],
                 kinds=[getattr(e, "client_kind", "sglang") for e in engines],
                 api_keys=[getattr(e, "api_key", None) for e in engines])
    progress(f"p2p: senders connected in {time.perf_counter() - t0:.1f} s")
    results = []
    try:
        for step in range(1, steps + 1):
            seed, changed = _version(step, seed_base, changed_fraction)
            # the step's HF tensors, made before the clock starts; from the second step on, the copy
            # plans recorded in the background, as a trainer's step between updates lets them finish
            waited = pool.prepare(seed, changed, plans_wait=PLANS_WAIT_S if step > 1 else 0.0)
            if waited >= 0.1:
                progress(f"p2p: before step {step} the senders waited {waited:.1f} s for the copy plans they record "
                         "in the background (in a real run the trainer's rollout and training step give them this "
                         "time); this step checks each against the loaders (slower), the next ones replay them")
            verified = verify == "on" or (verify == "alternate" and step % 2 == 0)
            sent = time.perf_counter()
            replies = pool.go(f"p2p-{step}", timeout, verified)
            round_trip = time.perf_counter() - sent
            failed = [p for k, p in replies if k == "failed"]  # a group fails every sender together: each says what it saw
            done = [p for k, p in replies if k == "done"]
            # pause returned -> update returned, as sender 0 measured it (the broadcast's clock); a failed
            # step has no report: the coordinator's round trip, an upper bound
            seconds = replies[0][1]["seconds"] if replies[0][0] == "done" else round_trip
            nbytes = max((p["bytes_max"] for p in done), default=0)
            equal, why = _check(engines, seed, check, changed, checker) if not failed else (False, "; ".join(failed))
            slowest = max(done, key=lambda p: p["loading"] + p["waiting"], default={"loading": 0.0, "waiting": 0.0})
            results.append(StepResult("p2p", transport, step, seconds, nbytes, nbytes / seconds / 1e9 if seconds else 0.0,
                                      equal, why, slowest["loading"], slowest["waiting"], verified,
                                      max((p.get("verify", 0.0) for p in done), default=0.0),
                                      [p["cpu"] for p in done], [p["caller_cpu"] for p in done],
                                      bytes_written=max((p["written_max"] for p in done), default=None),
                                      delta_reason="; ".join(sorted({w for p in done for w in p["reasons"]}))))
            progress(_row_text(results[-1]))
            if verbose:
                for i, p in enumerate(done):
                    progress(f"    sender {i}: " + p["report"].replace("\n", "\n    "))
            if failed:
                raise RuntimeError(f"p2p step {step} failed: {'; '.join(failed)}")
    finally:
        pool.close()
    return results


def run_broadcast(model: str, engines: Sequence[Any], *, steps: int, check: bool, progress: Callable[[str], None],
                  seed_base: int = 1000, backend: str = "gloo", changed_fraction: float | None = None,
                  checker: Checker | None = None) -> list[StepResult]:
    from ..baseline.broadcast import BroadcastSender
    from ..control import SglangEngine
    from ..models.checkpoint import checkpoint_tensors, random_checkpoint
    from ..models.quant import quant_scheme
    from ..models.registry import load_config

    clients = [SglangEngine(e.url, name=e.name) for e in engines]
    specs = checkpoint_tensors(model)  # the engine's checkpoint: FP8 + scales for an FP8 model
    scheme = quant_scheme(load_config(model))  # FP8: quantized from the seeded BF16 a trainer holds
    progress(f"broadcast: one sender joins a {backend} group with every engine rank")
    results = []
    with BroadcastSender(clients, backend=backend) as bcast:
        for step in range(1, steps + 1):
            seed, changed = _version(step, seed_base, changed_fraction)
            tensors = list(random_checkpoint(specs, seed, scheme, changed=changed))
            report = bcast.update(tensors, version=f"broadcast-{step}")
            seconds = report.seconds
            nbytes = sum(int(t.numel()) * t.element_size() for _, t in tensors)  # every rank receives every byte
            equal, why = _check(engines, seed, check, changed, checker)
            results.append(StepResult("broadcast", backend, step, seconds, nbytes, nbytes / seconds / 1e9, equal, why))
            progress(_row_text(results[-1]))
    return results


def _row_text(r: StepResult) -> str:
    eq = {True: "yes", False: "NO", None: "-"}[r.equal]
    written = f" ({format_size(r.bytes_written)} written)" if r.bytes_written != r.bytes else ""
    return (f"{r.label:>9}  {r.transport:>8}  step {r.step}  {format_size(r.bytes):>10} per engine rank{written}  "
            f"{r.seconds:7.3f} s  {r.gbps:6.2f} GB/s  equal: {eq}"
            + (f"  sender CPU {'/'.join(f'{c:.2f}' for c in r.sender_cpu_seconds)} s" if r.sender_cpu_seconds else "")
            + (f"  full write: {r.delta_reason}" if r.delta_reason else "")
            + (f"  ({r.detail})" if r.detail and not r.equal else ""))


def run_demo(model: str, *, engines: int = 2, engine: str = "tp=2", senders: int = 2, steps: int = 2,
             transport: str = "mooncake", modes: Sequence[str] = ("p2p", "broadcast"), check: bool = True,
             overrides: dict | None = None, progress: Callable[[str], None] = print,
             verbose: bool = False, verify: str = "off", changed_fraction: float | None = None) -> list[StepResult]:
    """``changed_fraction``: step k of each mode writes version k of a changed family (module docstring)."""
    from ..receiver import LocalEngine, start_together

    t0 = time.perf_counter()
    progress(f"starting {engines} engine(s) x {engine} as receiver processes ({transport}) ...")
    running = [LocalEngine(model, engine, name=f"engine{i}", transport=transport) for i in range(engines)]
    pool = None

    def start_senders() -> None:  # the senders build their replicas while the engines start
        nonlocal pool
        if "p2p" in modes:
            log_dir = None if verbose else tempfile.mkdtemp(prefix="p2pw-demo-")
            pool = SenderPool(model, senders, {"transport": transport, **(overrides or {})}, log_dir, timeout=STEP_TIMEOUT)

    try:
        start_together(running, start_senders)
    except BaseException:
        if pool is not None:
            pool.close()
        raise
    progress(f"engines up in {time.perf_counter() - t0:.1f} s: " + ", ".join(f"{e.name} {e.url}" for e in running))
    results: list[StepResult] = []
    try:
        if "p2p" in modes:
            results += run_p2p(model, running, senders=senders, steps=steps, transport=transport, check=check,
                               overrides=overrides or {}, progress=progress, pool=pool, verbose=verbose,
                               verify=verify, changed_fraction=changed_fraction)
        if "broadcast" in modes:
            results += run_broadcast(model, running, steps=steps, check=check, progress=progress,
                                     changed_fraction=changed_fraction)
    finally:
        for e in running:
            e.close()
    return results


def results_json(results: Sequence[StepResult]) -> dict:
    return {"steps": [{**asdict(r), "outside_fraction": r.outside_fraction} for r in results]}
