"""`p2pweights demo --engine-kind vllm`: the demo's P2P steps against stand-in vLLM 0.33 engines.

vLLM's own server cannot run on this CPU host (docs/vllm.md, "What could not run on these machines"),
so each engine is the harness of docs/vllm.md ("How it was tested"): a worker process
(``vllm_backend/cpu_worker.py``: vLLM's ``CpuPlatform``, config, Qwen3 model classes, ``load_weights``
and post-processing, the ``p2pweights`` backend made by vLLM's factory, vLLM's ``CPUWorker`` methods
through ``run_method``) behind vLLM's own RL and dev routers, exception handlers and middleware
registration (``--api-key`` and the gate from ``--middleware``) served by uvicorn on 127.0.0.1, in this
process (``vllm_backend/standin_api.py``; ``AsyncLLM`` is a stand-in running ``AsyncLLM``'s own
weight-transfer methods). Each worker registers its parameters over Mooncake
(``/init_weight_transfer_engine``). The senders are the demo's own (``SenderPool``, ``run_p2p``) with
:class:`~..control.VllmEngine` clients and the engine's key.

The check after every step is vLLM's own: ``/weight_checker`` (action ``checksum``: SHA-256 of every
parameter) against vLLM's checksums of a fresh CPU load of the step's HF tensors by vLLM's own
``load_weights`` and post-processing, made in a reference process of this module (``python -m
p2pweights.commands.demo_vllm CONFIG_DIR DIST_PORT``), as tests/test_vllm_sender.py does.

An engine of ``--engine tp=N`` runs N worker processes (one per TP rank, one gloo group), and the
check's reference loads at the same tp (N processes), keyed per TP rank as vLLM's checksums are.
``dp=M`` runs M such groups, each an independent engine as vLLM runs a dense model's DP ranks; each
DP rank's checksums must equal the tp reference. Refused up front: any layout key but tp and dp
(ep and pp were not run), FP8 models (not run
through the harness), ``--transport nixl`` (the harness's engines register over Mooncake only) and
the broadcast mode: vLLM's own baseline (``/init_weight_transfer_engine`` with its NCCL backend, then
``update_weights`` broadcasts) needs NCCL on GPUs, which this host lacks.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable, Mapping, Sequence

from ..errors import EngineError, UnsupportedLayout, WrongTransport
from ..models.engine_layout import parse_layout_spec
from ..replica.vllm_layout import VllmLayout
from ..vllm_backend.standin_engine import START_TIMEOUT_S, TRANSPORT, StandInVllmEngine, json_line, stop_process
from .demo_run import STEP_TIMEOUT, Checker, SenderPool, StepResult, _free_port, run_p2p

KIND = "vllm"
HONOURED = frozenset({"tp_size", "attn_dp_size"})  # tp and dp, as parse_layout_spec names them
WHY_TP_ONLY = ("the demo's stand-in vLLM engines take tensor and data parallelism only (one CPU worker process "
               "per rank; dense DP ranks as vLLM runs them); ep and pp were not run through them")
WHY_MOONCAKE = ("the demo's stand-in vLLM engines register their workers' memory over Mooncake only "
                "(NIXL was not run through the harness)")
WHY_NO_BROADCAST = ("vLLM's own broadcast baseline (its NCCL weight-transfer backend) needs NCCL on GPUs, which "
                    "the CPU stand-in engines lack; the vLLM demo runs p2p only")
WHY_NO_FP8 = ("the demo's stand-in vLLM engines were run with BF16 models only (an FP8 model's vLLM "
              "post-processing on the CPU platform was not run); use --engine-kind receiver")


def require_vllm() -> None:
    """Make vLLM importable here and in the demo's child processes (``replica.vllm_site``: this
    Python's vLLM, else ``.vllm_site`` or ``P2PW_VLLM_SITE``); refuse (one line, exit 2) where none is."""
    from ..replica.vllm_site import ensure_vllm

    ensure_vllm(f"demo --engine-kind {KIND}")


def engine_layout(spec: str) -> VllmLayout:
    """``--engine`` for this kind: ``tp=N,dp=M``, every other key refused (one line, exit 2)."""
    given = parse_layout_spec(spec, command=f"demo --engine-kind {KIND}", honours=HONOURED, why=WHY_TP_ONLY)
    return VllmLayout(tp=int(given.get("tp_size", 1)), dp=int(given.get("attn_dp_size", 1)))


def pick_transport(name: str) -> tuple[str, str]:
    """(transport, why) for --transport with stand-in vLLM engines: mooncake; nixl refused."""
    if name == "nixl":
        raise WrongTransport(f"--transport nixl: {WHY_MOONCAKE}; use --transport mooncake (or auto) with "
                             f"--engine-kind {KIND}")
    return TRANSPORT, f" (engine kind {KIND}: {WHY_MOONCAKE})" if name != TRANSPORT else ""


def refuse_modes(modes: Sequence[str]) -> None:
    if "broadcast" in modes:
        raise UnsupportedLayout(f"--modes broadcast: {WHY_NO_BROADCAST}; use --modes p2p")


def _model_dir(model: str) -> str:
    """The folder vLLM's ``EngineArgs(model=)`` takes (the demo also accepts a config.json's path)."""
    return model if os.path.isdir(model) else os.path.dirname(os.path.abspath(model))


def _vllm_environment() -> None:
    """What the harness needs before vLLM is imported here or in a child (workers, senders, the
    reference): vLLM's CpuPlatform, the dev mode that mounts vLLM's RL routes, and vLLM's log on
    stderr (the demo's rows and its --json own stdout)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_SERVER_DEV_MODE", "1")


class References:
    """vLLM's checksums of a fresh CPU load of a step's checkpoint at ``tp`` ranks, from ``tp``
    reference processes in their own gloo group (this module's ``__main__``), which import vLLM and
    build the model while the engines start; keyed ``tp<rank>:<name>``."""

    def __init__(self, model_dir: str, log_path: str, tp: int = 1):
        self._log = open(log_path, "ab")
        port = _free_port()
        self.procs: list[subprocess.Popen] = [subprocess.Popen(
            [sys.executable, "-m", __name__, model_dir, str(port), str(tp), str(rank)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._log, text=True) for rank in range(tp)]
        self._cache: dict[str, dict[str, str]] = {}

    def of(self, seed: int, changed: tuple[float, int] | None) -> dict[str, str]:
        key = json.dumps([seed, list(changed) if changed else None])
        if key not in self._cache:
            for proc in self.procs:  # every rank loads at once: their loaders may meet in a collective
                proc.stdin.write(key + "\n")
                proc.stdin.flush()
            merged: dict[str, str] = {}
            for rank, proc in enumerate(self.procs):
                merged.update(json_line(proc, START_TIMEOUT_S, f"the vLLM reference process of rank {rank}"))
            self._cache[key] = merged
        return self._cache[key]

    def close(self) -> None:
        for proc in self.procs:
            stop_process(proc)
        self.procs = []
        self._log.close()


def engine_checksums(engine: StandInVllmEngine) -> dict[str, str]:
    """vLLM's ``/weight_checker`` checksums of an engine, keyed ``dp<i>:tp<rank>:<name>``."""
    from ..control import VllmEngine

    answer = VllmEngine(engine.url, api_key=engine.api_key, name=engine.name, timeout=STEP_TIMEOUT).weights_checker()
    sums = answer.get("checksums") if isinstance(answer, dict) else None
    if not isinstance(sums, dict):
        raise EngineError(f"{engine.name}: /weight_checker answered no checksums")
    out = {}
    for key, digest in sums.items():  # vLLM's "dp0:pp0:pcp0:tp0:<name>"
        dp, _, _, rest = key.split(":", 3)
        out[f"{dp}:{rest}"] = digest
    return out


def compare(held: Mapping[str, str], want: Mapping[str, str], name: str) -> tuple[bool, str]:
    """(equal, why not) of one engine's checksums against the reference's."""
    differ = sorted(n for n in set(held) | set(want) if held.get(n) != want.get(n))
    if not differ:
        return True, ""
    shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
    return False, f"{name}: {len(differ)} of {len(want)} parameter(s) differ from a fresh vLLM load: {shown}"


def checksum_checker(references: References, engines: Sequence[StandInVllmEngine],
                     progress: Callable[[str], None], verbose: bool = False, dp: int = 1) -> Checker:
    def check(seed: int, changed: tuple[float, int] | None) -> tuple[bool, str]:
        t0 = time.perf_counter()
        # every DP rank of a dense model holds what the tp reference loads
        want = {f"dp{i}:{key}": d for key, d in references.of(seed, changed).items() for i in range(dp)}
        t1 = time.perf_counter()
        results = [compare(engine_checksums(e), want, e.name) for e in engines]
        if verbose:
            progress(f"    check: a fresh vLLM load's checksums in {t1 - t0:.1f} s, vLLM's /weight_checker of "
                     f"{len(engines)} engine(s) in {time.perf_counter() - t1:.1f} s")
        bad = [why for equal, why in results if not equal]
        return not bad, "; ".join(bad)

    return check


def run_vllm_demo(model: str, *, engines: int = 1, engine: str = "tp=1", senders: int = 1, steps: int = 2,
                  transport: str = TRANSPORT, modes: Sequence[str] = ("p2p",), check: bool = True,
                  overrides: dict | None = None, progress: Callable[[str], None] = print, verbose: bool = False,
                  verify: str = "off", changed_fraction: float | None = None) -> list[StepResult]:
    """The demo's P2P steps against ``engines`` stand-in vLLM engines (``engine``: ``tp=N,dp=M``);
    refusals as the module docstring says, before anything starts."""
    require_vllm()
    layout = engine_layout(engine)
    tp, dp = layout.tp, layout.dp
    pick_transport(transport)
    refuse_modes(modes)
    _vllm_environment()
    overrides = overrides or {}
    model_dir = _model_dir(model)
    log_dir = tempfile.mkdtemp(prefix="p2pw-demo-vllm-")
    t0 = time.perf_counter()
    progress(f"starting {engines} stand-in vLLM engine(s) x tp={tp} x dp={dp} on the CPU (vLLM's CpuPlatform worker, vLLM's "
             f"routes and the gate over uvicorn, weights registered over Mooncake TCP on 127.0.0.1; logs in "
             f"{log_dir}) ...")
    running: list[StandInVllmEngine] = []
    pool: SenderPool | None = None
    references: References | None = None
    results: list[StepResult] = []
    try:
        for i in range(engines):
            running.append(StandInVllmEngine(model_dir, os.path.join(log_dir, f"engine{i}.log"), f"engine{i}", tp=tp,
                                             dp=dp))
        if "p2p" in modes:  # the senders import vLLM and build their replicas while the engines start
            pool = SenderPool(model, senders, {"transport": TRANSPORT, **overrides},
                              None if verbose else log_dir, timeout=STEP_TIMEOUT)
        if check:  # and so does the reference process
            references = References(model_dir, os.path.join(log_dir, "reference.log"), tp)
        for e in running:
            e.wait_ready()
        progress(f"engines up in {time.perf_counter() - t0:.1f} s: " + ", ".join(f"{e.name} {e.url}" for e in running))
        checker = checksum_checker(references, running, progress, verbose, dp) if references is not None else None
        if "p2p" in modes:
            started, pool = pool, None  # run_p2p closes it
            results += run_p2p(model, running, senders=senders, steps=steps, transport=TRANSPORT, check=check,
                               overrides=overrides, progress=progress, pool=started, verbose=verbose,
                               verify=verify, changed_fraction=changed_fraction, checker=checker)
    finally:
        if pool is not None:
            pool.close()
        if references is not None:
            references.close()
        for e in running:
            e.close()
    return results


def _reference_main(config_dir: str, dist_port: int, tp: int = 1, rank: int = 0) -> int:
    """Per JSON line ``[seed, changed]`` on stdin: vLLM's checksums of a fresh CPU load of that
    checkpoint for TP rank ``rank`` of ``tp`` (one model, loaded again by vLLM's own ``load_weights``
    and post-processed), one line, keyed ``tp<rank>:<name>``."""
    out = os.fdopen(os.dup(1), "w")  # the answers own stdout; what vLLM prints goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _vllm_environment()
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    from ..models.checkpoint import checkpoint_tensors, random_checkpoint
    from ..vllm_backend import cpu_worker

    vc = cpu_worker.engine_config(config_dir, tp)
    model = cpu_worker.build_model(vc, config_dir, 1, dist_port, rank=rank)
    specs = checkpoint_tensors(config_dir)
    for line in sys.stdin:
        seed, changed = json.loads(line)
        with set_current_vllm_config(vc):
            model.load_weights(random_checkpoint(specs, seed, changed=tuple(changed) if changed else None))
            process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
        print(json.dumps({f"tp{rank}:{n}": d for n, d in compute_tensor_digests(model).items()}), file=out,
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_reference_main(sys.argv[1], *(int(a) for a in sys.argv[2:5])))
