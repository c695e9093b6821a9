"""A vLLM 0.33 worker on a host where vLLM's own worker cannot run (a CPU-only machine: the CUDA
wheel has no CPU kernels: docs/vllm.md, "What could not run on these machines"), for the tests and
``p2pweights demo --engine-kind vllm``: one process standing where one of vLLM's worker processes
would (an engine of tp ranks runs tp of them).

What is vLLM's own here: the platform (``VLLM_TARGET_DEVICE=cpu``: ``CpuPlatform``), the config
(``EngineArgs(..., tensor_parallel_size=tp, weight_transfer_config={"backend": "p2pweights"})``),
the distributed groups (gloo, one rank per worker process), the model classes, their
``load_weights`` (which shard for the worker's TP rank) and post-processing, the backend made by
``WeightTransferEngineFactory.create_engine`` as ``gpu_worker.load_model`` makes it, and the worker
methods every RPC runs (``CPUWorker``'s ``init_weight_transfer_engine``, ``start_weight_update``,
``update_weights``, ``finish_weight_update``, ``compute_weight_checksums``, ``reset_weights``),
called through vLLM's ``run_method`` as its executors call them. Not vLLM's: the worker object is
made without ``Worker.__init__`` (``WorkerBase.__init__`` only: no device setup, KV cache or
compile), its model runner is a holder of the model, and the RPCs arrive over a
``multiprocessing.connection`` (authkey) instead of vLLM's ZMQ engine-core channel.

With ``--spec mtp`` the engine runs vLLM's MTP drafter too (``speculative_config={"method": "mtp"}``):
built as vLLM's proposer builds it (``initialize_model`` with the draft's model config, its own
``load_weights`` from the same checkpoint, post-processing), then given the target's embedding and LM
head by the proposer's own ``_maybe_share_embeddings`` / ``_maybe_share_lm_head``; the model runner
answers ``get_draft_model`` with it, as vLLM's does.

With ``--hopper LAYOUT`` (a ``VllmLayout`` spec, e.g. ``tp=2,ep=2``: vLLM's defaults otherwise,
``VLLM_USE_DEEP_GEMM`` unset, FlashInfer present) the worker holds what a Hopper (sm90) engine rank
of that layout holds, FP8 MoE included, which vLLM's ``CpuPlatform`` cannot build: its rank is built,
loaded from the same random checkpoint and post-processed by the replica's own reference path
(``replica.vllm_check.reference_model`` under ``replica.vllm_env``'s Hopper stand-in: DeepGEMM's E8M0
requantization of FP8 block linears, FlashInfer CUTLASS's w13 swap of FP8 experts), and every RPC runs
inside ``vllm_env.activate`` of that rank (its stand-in parallel groups, the engine's kernel answers),
so the backend's finish post-processes as that engine does. The worker is vLLM's GPU ``Worker``. Its
ranks form no gloo group: a rank's groups are the stand-in's (rank lists), which is all building,
loading, post-processing and the backend ask of them; no RPC runs a collective.

With ``--lora`` the engine runs vLLM's LoRA (``--enable-lora`` and its flags): vLLM's own
``load_lora_model`` wraps the model before the backend is made, and the model runner's LoRA methods
(``add_lora``, ``pin_lora``, ...) are vLLM's ``LoRAModelRunnerMixin``'s.

    python -m p2pweights.vllm_backend.cpu_worker --model CONFIG_DIR --seed 1 --dist-port P [--tp 2 --rank R] [--spec mtp]
        [--lora '{"max_lora_rank": 8, "max_loras": 2}']
        [--dp 2 --dp-rank D]   # a dense model's DP rank D: an independent engine of its own (its own --dist-port)
        [--hopper tp=2,ep=2]   # a Hopper engine rank of that layout (--tp must be its tp)
    # prints {"event": "ready", "rank": R, "address": [host, port], "pid": ...}; the authkey comes on stdin (hex)
    # the --tp workers of one engine share --dist-port (gloo's rendezvous) and start together
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from typing import Any

from ..models.checkpoint import checkpoint_tensors, random_checkpoint
from ..replica import vllm_env
from ..replica.vllm_check import reference_model
from ..replica.vllm_layout import VllmLayout
from ..replica.vllm_lora import VllmLoRASetting
from . import BACKEND, register


class ModelHolder:
    """What the worker methods the backend's RPCs run ask of a model runner. With LoRA
    (:meth:`load_lora_model`), its LoRA methods are vLLM's ``LoRAModelRunnerMixin``'s own: ``add_lora``,
    ``remove_lora``, ``pin_lora``, ``list_loras`` and ``reset_lora_state`` (which vLLM's
    ``finish_weight_update`` runs after a base-weights update: every adapter is dropped from the
    worker, as in vLLM)."""

    def __init__(self, model: Any, draft: Any = None):
        self.model, self.draft = model, draft
        self.lora_config = None

    def get_model(self) -> Any:
        return self.model

    def get_draft_model(self) -> Any:
        return self.draft

    def load_lora_model(self, vllm_config: Any) -> None:
        """vLLM's own ``load_lora_model``: the LoRA wrappers and their tensors over the model."""
        import torch
        from vllm.config import set_current_vllm_config

        self.lora_config = vllm_config.lora_config
        with set_current_vllm_config(vllm_config):
            self.model = _lora_mixin().load_lora_model(self, self.model, vllm_config, torch.device("cpu"))

    def _ensure_lora_enabled(self) -> None:  # what vLLM's mixin methods call on their model runner
        _lora_mixin()._ensure_lora_enabled(self)

    def reset_lora_state(self) -> None:
        if self.lora_config is not None:  # vLLM's own returns at once without LoRA too
            _lora_mixin().reset_lora_state(self)

    def add_lora(self, lora_request: Any) -> bool:
        return _lora_mixin().add_lora(self, lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return _lora_mixin().remove_lora(self, lora_id)

    def pin_lora(self, lora_id: int) -> bool:
        return _lora_mixin().pin_lora(self, lora_id)

    def list_loras(self) -> set[int]:
        return _lora_mixin().list_loras(self)


def _lora_mixin() -> Any:
    from vllm.v1.worker.lora_model_runner_mixin import LoRAModelRunnerMixin

    return LoRAModelRunnerMixin


SPECS = ("", "mtp")  # --spec: none, or vLLM's MTP drafter of the target's own checkpoint


def engine_config(config_dir: str, tp: int = 1, spec: str = "", dp: int = 1, dp_rank: int | None = None,
                  lora: Any = None) -> Any:
    """vLLM's config of a ``dp`` x ``tp``-rank engine for ``config_dir`` with the ``p2pweights``
    backend (and vLLM's MTP drafter with ``spec="mtp"``; vLLM's LoRA with ``lora``, a
    ``replica.vllm_lora.VllmLoRASetting``: ``--enable-lora`` and its flags): the API server's (``dp_rank`` None), or
    that of a worker of DP rank ``dp_rank``. vLLM runs the DP ranks of a dense model as independent
    engines (``EngineCoreProc``: ``reconfigure_for_independent_dp_rank``, keeping
    ``data_parallel_index``), and so does this; an MoE model's DP ranks share their groups in vLLM,
    which the stand-in does not run."""
    import torch
    from vllm.engine.arg_utils import EngineArgs

    if spec not in SPECS:
        raise ValueError(f"spec must be one of {SPECS}, got {spec!r}")
    register()  # what the vllm.general_plugins entry point runs (an installed wheel's metadata may predate it)
    extra: dict[str, Any] = dict(lora.engine_args()) if lora is not None else {}
    if spec:
        extra["speculative_config"] = {"method": spec, "num_speculative_tokens": 1}
    if not hasattr(torch.ops._C, "convert_weight_packed"):
        # MLA models: vLLM prefers its AMX MLA backend on an AMX CPU, whose post-processing packs
        # W_UK / W_UV through that absent op; its reference CPU MLA backend keeps them as loaded
        extra["attention_config"] = {"backend": "CPU_MLA"}
    config = EngineArgs(model=config_dir, skip_tokenizer_init=True, dtype="bfloat16", load_format="dummy",
                        enforce_eager=True, max_model_len=256, tensor_parallel_size=tp, data_parallel_size=dp,
                        weight_transfer_config={"backend": "p2pweights"}, **extra).create_engine_config()
    if dp > 1 and config.model_config.is_moe:
        raise ValueError("the stand-in vLLM engine runs data parallelism for dense models only (an MoE model's DP "
                         "ranks share process groups in vLLM: DPEngineCoreProc)")
    if dp_rank is not None:  # a worker: its DP rank is an independent engine, as vLLM's EngineCoreProc makes it
        if not 0 <= dp_rank < dp:
            raise ValueError(f"DP rank {dp_rank} is not a rank of dp={dp}")
        config.parallel_config.data_parallel_index = dp_rank
        config.parallel_config.reconfigure_for_independent_dp_rank()
    without_absent_cpu_kernels()
    return config


def without_absent_cpu_kernels() -> None:
    """On a CPU with AMX tiles, vLLM's CPU GEMM dispatch (``dispatch_cpu_unquantized_gemm``, run by
    post-processing) packs small BF16 weights for sgl-kernel through ``torch.ops._C``, which the CUDA
    wheel installed here lacks (AttributeError at load). Where that op is absent, the dispatch is
    made to take vLLM's path of a CPU without AMX (``check_cpu_sgl_kernel`` false: weights stay
    where they were loaded). A real AMX CPU engine would repack and drop them, which the backend
    refuses (``RankMemory.check_in_place``)."""
    import torch
    from vllm.model_executor.layers import utils

    if not hasattr(torch.ops._C, "convert_weight_packed"):
        utils.check_cpu_sgl_kernel = lambda n, k, dtype: False


def hopper_layout(spec: str, tp: int | None = None) -> VllmLayout:
    """``--hopper``'s layout: one DP rank (an MoE engine's DP ranks share their groups in vLLM, which
    the stand-in does not run); ``tp``, where given, must be the layout's."""
    layout = VllmLayout.parse(spec, command="cpu_worker --hopper")
    if layout.dp != 1 or layout.spec:
        raise ValueError(f"--hopper {spec}: the stand-in's Hopper engine runs one DP rank and no draft")
    if tp is not None and layout.tp != tp:
        raise ValueError(f"--hopper {spec} has tp={layout.tp}, the engine runs --tp {tp}")
    return layout


def hopper_engine_config(config_dir: str, layout: VllmLayout) -> Any:
    """vLLM's config of a Hopper engine of ``layout`` with the ``p2pweights`` backend: the replica's
    (``vllm_env.engine_config``, under the Hopper stand-in), copied with ``weight_transfer_config``
    set (the replica's cached config is left as it is)."""
    from vllm.config import WeightTransferConfig

    vllm_env.prepare()
    register()
    config = copy.copy(vllm_env.engine_config(config_dir, layout))
    config.weight_transfer_config = WeightTransferConfig(backend=BACKEND)
    return config


def build_hopper_rank(config_dir: str, layout: VllmLayout, seed: int, rank: int) -> Any:
    """Engine rank ``rank`` of a Hopper engine of ``layout``: vLLM's model built, loaded from
    ``random_checkpoint(checkpoint_tensors(config), seed, quant_scheme(config))`` and post-processed
    under the Hopper stand-in, by the replica's reference path (``vllm_check.reference_model``)."""
    vllm_env.prepare()
    return reference_model(config_dir, layout, rank, seed=seed)


def build_model(vllm_config: Any, config_dir: str, seed: int, dist_port: int, *, post_process: bool = True,
                rank: int = 0) -> Any:
    """TP rank ``rank``'s part of vLLM's model class of ``config_dir`` on the CPU, loaded by its own
    ``load_weights`` (which shards for the rank) from p2pweights' random checkpoint ``seed`` (HF
    names), post-processed by vLLM (``post_process``). With tp > 1 (``vllm_config``) every rank's
    process calls this with the same ``dist_port``: gloo's rendezvous waits for all of them."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(vllm_config):
        tp = int(vllm_config.parallel_config.tensor_parallel_size)
        init_distributed_environment(world_size=tp, rank=rank, local_rank=rank, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{dist_port}")
        initialize_model_parallel(tensor_model_parallel_size=tp)
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config)
        model.load_weights(random_checkpoint(checkpoint_tensors(config_dir), seed))
        if post_process:
            process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    return model


def build_draft(vllm_config: Any, config_dir: str, seed: int, target: Any) -> Any:
    """vLLM's drafter of this rank (``vllm_config.speculative_config``), as its proposer builds and loads
    it (``llm_base_proposer.load_model``): the draft's model class from its model config, loaded by its
    own ``load_weights`` from the same checkpoint, post-processed, then sharing the target's embedding
    and LM head through the proposer's own methods. Call after :func:`build_model` (its groups)."""
    import types

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    draft_config = vllm_config.speculative_config.draft_model_config
    with set_current_vllm_config(vllm_config):
        with set_default_torch_dtype(draft_config.dtype), torch.device("cpu"):
            draft = initialize_model(vllm_config=vllm_config, model_config=draft_config)
        draft.load_weights(random_checkpoint(checkpoint_tensors(config_dir), seed))
        process_weights_after_loading(draft, draft_config, torch.device("cpu"))
        proposer = types.SimpleNamespace(model=draft, vllm_config=vllm_config,  # what the two methods read
                                         use_local_argmax_reduction=False)
        SpecDecodeBaseProposer._maybe_share_embeddings(proposer, target)
        SpecDecodeBaseProposer._maybe_share_lm_head(proposer, target)
    return draft


def make_worker(vllm_config: Any, model: Any, rank: int = 0, draft: Any = None, *, hopper: bool = False) -> Any:
    """vLLM's ``CPUWorker`` (``hopper``: its GPU ``Worker``, whose weight-transfer methods ``CPUWorker``
    inherits) of TP rank ``rank`` holding ``model``, its backend made by vLLM's factory.
    With LoRA (``vllm_config.lora_config``), vLLM's ``load_lora_model`` wraps the model first, as
    ``GPUModelRunner.load_model`` does before the worker makes its backend."""
    import torch
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.v1.worker.worker_base import WorkerBase

    if hopper:
        from vllm.v1.worker.gpu_worker import Worker as worker_class
    else:
        from vllm.v1.worker.cpu_worker import CPUWorker as worker_class
    worker = object.__new__(worker_class)
    WorkerBase.__init__(worker, vllm_config=vllm_config, local_rank=rank, rank=rank,
                        distributed_init_method="", is_driver_worker=rank == 0)
    worker.device = torch.device("cpu")
    worker.model_runner = holder = ModelHolder(model, draft)
    if vllm_config.lora_config is not None:
        holder.load_lora_model(vllm_config)
    worker._weight_update_active, worker._weight_update_is_draft = False, False
    worker.weight_transfer_engine = WeightTransferEngineFactory.create_engine(  # as gpu_worker.load_model
        vllm_config.weight_transfer_config, vllm_config, worker.device, holder.get_model())
    return worker


def serve(worker: Any, vllm_config: Any, authkey: bytes, out: Any, rank: int = 0) -> None:
    """Run each RPC that arrives with vLLM's ``run_method`` on ``worker``, one at a time."""
    from multiprocessing.connection import Listener

    from vllm.config import set_current_vllm_config
    from vllm.v1.serial_utils import run_method

    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        print(json.dumps({"event": "ready", "rank": rank, "address": list(listener.address), "pid": os.getpid()}), file=out,
              flush=True)
        while True:
            with listener.accept() as conn:
                while True:
                    try:
                        method, args, kwargs = conn.recv()
                    except EOFError:
                        break
                    if method == "exit":
                        return
                    try:
                        with set_current_vllm_config(vllm_config):
                            conn.send(("ok", run_method(worker, method, tuple(args), dict(kwargs))))
                    except Exception as e:  # noqa: BLE001 - vLLM's engine core reports a worker's error as text
                        conn.send(("error", f"{type(e).__name__}: {e}"))


def lora_setting(text: str | None) -> Any:
    """``--lora``'s JSON as a VllmLoRASetting (None: LoRA off)."""
    if not text:
        return None
    return VllmLoRASetting(**json.loads(text))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dist-port", type=int, required=True)
    ap.add_argument("--tp", type=int, default=1, help="the engine's tensor-parallel size (its worker count)")
    ap.add_argument("--rank", type=int, default=0, help="this worker's TP rank, 0 .. tp-1")
    ap.add_argument("--spec", default="", choices=SPECS, help="mtp: run vLLM's MTP drafter of the checkpoint too")
    ap.add_argument("--dp", type=int, default=1, help="the engine's data-parallel size (dense models)")
    ap.add_argument("--dp-rank", type=int, default=0, help="this worker's DP rank, 0 .. dp-1")
    ap.add_argument("--lora", default=None, help="vLLM's LoRA (--enable-lora ...) as JSON: VllmLoRASetting's fields")
    ap.add_argument("--hopper", default="", metavar="LAYOUT",
                    help="hold what a Hopper engine rank of this vLLM layout holds (e.g. tp=2,ep=2; FP8 MoE too)")
    args = ap.parse_args(argv)
    if not 0 <= args.rank < args.tp:
        ap.error(f"--rank {args.rank} is not a rank of --tp {args.tp}")
    if args.hopper and (args.spec or args.lora or args.dp != 1):
        ap.error("--hopper runs one DP rank without --spec or --lora")
    out = os.fdopen(os.dup(1), "w")  # the ready line owns stdout; what vLLM prints goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    authkey = bytes.fromhex(sys.stdin.readline().strip())
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if args.hopper:
        return serve_hopper_rank(args.model, hopper_layout(args.hopper, args.tp), args.seed, args.rank, authkey, out)
    vllm_config = engine_config(args.model, args.tp, args.spec, args.dp, args.dp_rank, lora_setting(args.lora))
    model = build_model(vllm_config, args.model, args.seed, args.dist_port, rank=args.rank)
    draft = build_draft(vllm_config, args.model, args.seed, model) if args.spec else None
    worker = make_worker(vllm_config, model, args.rank, draft)
    try:
        serve(worker, vllm_config, authkey, out, args.rank)
    finally:
        worker.weight_transfer_engine.shutdown()
    return 0


def serve_hopper_rank(config_dir: str, layout: VllmLayout, seed: int, rank: int, authkey: bytes, out: Any) -> int:
    """``--hopper``: build the Hopper engine rank, then serve every RPC inside its rank's vLLM context
    (``vllm_env.activate``: this process is that rank for its whole life)."""
    model = build_hopper_rank(config_dir, layout, seed, rank)
    vllm_config = hopper_engine_config(config_dir, layout)
    with vllm_env.activate(model):
        worker = make_worker(vllm_config, model, rank, hopper=True)
        try:
            serve(worker, vllm_config, authkey, out, rank)
        finally:
            worker.weight_transfer_engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
