"""`p2pweights check-layout`: prove the replica path produces sglang's exact bytes.

    p2pweights check-layout --model MODEL --engine tp=2,ep=2[,dp_attention=2][,<arg>=<value>...]
                            [--rank R] [--seed S] [--json] [--engine-kind sglang|vllm]
                            [--lora R[,target,...] [--max-lora-rank N] [--max-loras-per-batch S]
                             [--lora-target-modules M ...]]

MODEL is a built-in name (qwen3-0.6b, ...), a config folder or a config.json. An --engine key
that does not decide a rank's bytes is refused (the replica would ignore it).

For every engine rank (or one): random HF tensors for the config go through the replica path
(probe, parameter groups, a slot) and through sglang's own load_weights into a fully
materialized model of that rank; every parameter is compared byte for byte. For an FP8
block-quantized config both read the same FP8 checkpoint (seeded BF16, quantized with the
sender's formula); ``dtypes`` counts the parameters compared per dtype. An engine running a
draft (``speculative_algorithm=NEXTN``) is checked per role: ``--json`` has ``"roles": {"target":
{...}, "draft": {...}}`` (docs/replica.md, "Roles"). Exit code 0 only when every role of every rank
is equal. Memory: one rank's parameters plus one slot; inputs are made per tensor.
``--engine-kind vllm``: the same proof against vLLM 0.33's load and post-processing (docs/vllm.md).
``--lora R[,targets]``: the replica's LoRA adapter slot bytes against the engine's own adapter load
of a random PEFT adapter, per rank (replica/lora_check.py, docs/lora.md).
"""
from __future__ import annotations

import argparse
import json
import sys

from ..models.engine_layout import EngineLayout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="MODEL",
                        help="a built-in model name (qwen3-0.6b, ...), a folder holding config.json, or the "
                             "config.json (weights are not read)")
    parser.add_argument("--engine", required=True, metavar="SPEC",
                        help="engine layout: tp=2,ep=2[,dp_attention=2][,<server arg>=<value>...]")
    parser.add_argument("--rank", type=int, default=None, help="check only this engine rank")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random HF tensors")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--engine-kind", choices=("sglang", "vllm"), default="sglang",
                        help="whose loaders to check against: sglang (default) or vllm 0.33 (--engine "
                             "tp=2,dp=2,ep=4,moe_backend=triton,deep_gemm=0; docs/vllm.md)")
    lora = parser.add_argument_group("LoRA adapters (docs/lora.md)")
    lora.add_argument("--lora", metavar="R[,TARGET...]", default=None,
                      help="check LoRA adapter slots instead of the base weights: a random PEFT adapter of rank R "
                           "over TARGETs (q,k,v,o,gate,up,down or q_proj,...; default all seven), loaded by the "
                           "engine's own code from files, against the replica's slot bytes on every rank")
    lora.add_argument("--max-lora-rank", type=int, default=None, metavar="N",
                      help="the engine's --max-lora-rank (default: the smallest of 8, 16, 32, 64, 128, 256, 320, "
                           "512 that holds R, the ranks vLLM accepts)")
    lora.add_argument("--max-loras-per-batch", type=int, default=None, metavar="S",
                      help="the engine's adapter slots: sglang's --max-loras-per-batch (slot 0 is the base "
                           "model's), vLLM's --max-loras (default 2); every adapter slot is checked")
    lora.add_argument("--lora-target-modules", nargs="+", default=None, metavar="M",
                      help="the engine's --lora-target-modules (default: sglang, the adapter's targets; vLLM, "
                           "its own default, every module it supports)")


def run(args: argparse.Namespace) -> int:
    from ..errors import P2PWeightsError
    from ..models import load_config, resolve_model
    from ..models.quant import quant_scheme
    from ..replica.roles import roles_of

    if args.engine_kind == "vllm":  # vLLM is imported only here
        from ..replica.vllm_site import ensure_vllm

        ensure_vllm("check-layout --engine-kind vllm")  # this Python's vLLM, else .vllm_site (or P2PW_VLLM_SITE)
    if args.lora is not None:
        from ..replica.lora_check import run_check_lora

        return run_check_lora(args.model, args.engine, args.lora, engine_kind=args.engine_kind, rank=args.rank,
                              seed=args.seed, max_lora_rank=args.max_lora_rank, slots=args.max_loras_per_batch,
                              target_modules=args.lora_target_modules, as_json=args.json)
    lora_only = [f for f, v in (("--max-lora-rank", args.max_lora_rank), ("--max-loras-per-batch",
                 args.max_loras_per_batch), ("--lora-target-modules", args.lora_target_modules)) if v is not None]
    if lora_only:  # the base-weight check would ignore them
        print(f"p2pweights check-layout: error: {lora_only[0]} needs --lora R[,targets]", file=sys.stderr)
        return 2
    if args.engine_kind == "vllm":
        from ..replica.vllm_check import run_check_layout
        from ..replica.vllm_env import refuse_what_vllm_refuses

        refuse_what_vllm_refuses(args.model, args.engine)  # vLLM's own refusal of the model: one line, exit 2
        return run_check_layout(args.model, args.engine, rank=args.rank, seed=args.seed, as_json=args.json)
    try:
        model = resolve_model(args.model)
        quant_scheme(load_config(model))  # a quantization p2pweights cannot write: refused up front
    except P2PWeightsError as e:
        print(f"p2pweights check-layout: error: --model: {e}", file=sys.stderr)
        return 2
    try:
        engine = EngineLayout.parse(args.engine, command="check-layout")
        roles = roles_of(model, engine)  # a draft model the replica cannot build: refused with the reason
    except P2PWeightsError as e:
        print(f"p2pweights check-layout: error: {e}", file=sys.stderr)
        return 2
    if args.rank is not None and not 0 <= args.rank < engine.world_size:
        print(f"p2pweights check-layout: --rank {args.rank} is not a rank of {engine.describe()} "
              f"({engine.world_size} ranks)", file=sys.stderr)
        return 2

    from ..replica.check import merged_dtypes
    from ..replica.model_replica import ModelReplicas
    from ..replica.role_check import check_rank_roles, role_mismatches, roles_json

    ranks = range(engine.world_size) if args.rank is None else [args.rank]
    replicas = ModelReplicas(cache_dir="")
    results, checks = [], []  # every role's RankCheck; per rank {role: RankCheck}
    for rank in ranks:
        try:
            per_role = check_rank_roles(model, engine, rank, seed=args.seed, replicas=replicas)
        except P2PWeightsError as e:
            if args.json:
                print(json.dumps({"equal": False, "params_checked": sum(r.params_checked for r in results),
                                  "ranks": [r.to_json() for r in results],
                                  "mismatches": [f"rank {rank}: {e}"], "error": str(e)}))
            else:
                print(f"rank {rank}: cannot build a replica: {e}", file=sys.stderr)
            return 1
        checks.append(per_role)
        for role, result in per_role.items():
            results.append(result)
            if args.json:
                continue
            verdict = "equal" if result.equal else f"{len(result.mismatches)} MISMATCHES"
            dtypes = ", ".join(f"{n} {d}" for d, n in sorted(result.dtypes.items()))
            who = f"rank {rank}" + (f" {role}" if len(roles) > 1 else "")
            print(f"{who}: {result.params_checked} params ({dtypes}), {result.bytes_checked / 1e6:.3f} MB, "
                  f"{result.groups} groups (largest {result.largest_group_bytes / 1e6:.3f} MB): {verdict} "
                  f"[{result.seconds:.1f} s]")
            for m in result.mismatches:
                print(f"  {m}")
    equal = all(r.equal for r in results)  # every role of every rank
    if args.json:
        print(json.dumps({
            "equal": equal,
            "params_checked": sum(r.params_checked for r in results),
            "dtypes": merged_dtypes(results),
            "ranks": [c["target"].to_json() for c in checks],
            "mismatches": [m for c in checks for role, r in c.items() for m in role_mismatches(role, r)],
            "roles": roles_json(checks),  # {"target": {equal, params_checked, ranks}, "draft": {...}}
        }))
    else:
        print(f"{engine.describe()}: {'OK, byte-exact' if equal else 'FAILED'} over {len(checks)} rank(s)"
              + (f" x {len(roles)} roles ({', '.join(roles)})" if len(roles) > 1 else ""))
    return 0 if equal else 1
