"""`p2pweights plan`: who sends what to which engine rank, and predicted seconds (P2P vs broadcast).

Every flag is documented in docs/plan.md.
"""
from __future__ import annotations

import argparse
import json
import sys

from ..errors import P2PWeightsError
from ..models import UnknownModel, load_config
from ..models.engine_layout import EngineLayout, parse_layout_spec
from ..models.shapes import DTYPE_BYTES, ModelShape, PlanError, model_shape
from ..models.stages import SPLITS
from ..planner.assign import Engine, Plan, TrainerLayout, layout_label, make_plan
from ..planner.cost import (
    GATHER_GBPS,
    GPUS_PER_NODE,
    HOST_DEVICE_GBPS,
    NIC_GBPS,
    PRODUCTION_GBPS,
    Cost,
    Links,
    predict,
)
from ..planner.delta_cost import (
    APPLY_GBPS,
    AREA_FRACTION,
    DETECT_GBPS,
    FIRST_FULL,
    DeltaPlan,
    DeltaRates,
    delta_unit,
    not_built_yet,
    parse_fractions,
    predict_deltas,
)
from ..planner.host_path import HOST_US_PER_TENSOR, SENDER_HOST_PATH, stage_tensor_counts
from ..planner.join_cost import predict_join, render_join
from .plan_vllm import vllm_engines

# The server args plan's cost model reads (by sglang name); any other --engine key is refused.
PLAN_KEYS = frozenset({"tp_size", "ep_size", "attn_dp_size", "enable_dp_lm_head",
                       "enforce_shared_experts_fusion", "disable_shared_experts_fusion"})
_PLAN_READS = ("its cost model reads only tp, ep (a number or tp), dp (attention DP, a number or tp), "
               "dp_lm_head and fused_shared_experts")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="MODEL",
                        help="a built-in model name (qwen3-0.6b, ...), an HF config.json, or the folder holding it")
    parser.add_argument("--trainer", required=True, metavar="tp=T,pp=P,ep=E,fsdp=F,gpus=G",
                        help="trainer parallelism; gpus is required, tp/pp/ep/fsdp default to 1 (fsdp: "
                             "parameters further sharded over that many data-parallel ranks)")
    parser.add_argument("--engines", required=True, metavar="NxG[,NxG...]",
                        help="engines as COUNTxGPUS items, e.g. 2x32 or 3x4,1x2")
    parser.add_argument("--engine", default="", metavar="tp=T,ep=E,dp=D,...",
                        help="shard layout of every engine: tp (default: the engine's GPU count), "
                             "ep (a number or 'tp'), dp (attention DP), dp_lm_head, fused_shared_experts")
    parser.add_argument("--balanced", action="store_true",
                        help="cap the reuse of a sender at ceil(engine ranks / senders) writes, so mixed shard "
                             "layouts do not pile writes on a few senders (default: the plain rule)")
    parser.add_argument("--pp-gathered", action="store_true",
                        help="the trainer gathers PP too: every trainer rank is a sender of the whole model")
    parser.add_argument("--split", default="engine_ranks", choices=SPLITS,
                        help="how a stage's senders share its writes: engine_ranks (default: each writes whole "
                             "engine ranks, so each gathers the whole stage) or layers (WeightSender(split="
                             "'layers'): the stage's layers split over them, each gathering only its layers and "
                             "writing them to every engine rank)")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_BYTES),
                        help="dtype of the unquantized weights sent and held by the engines (default bf16); "
                             "an FP8 block-quantized config's linear weights count 1 byte per element plus "
                             "a float32 scale per block whatever this says")
    parser.add_argument("--nic-gbps", type=float, default=NIC_GBPS,
                        help=f"each NIC's bandwidth in GB/s, trainer and engine nodes alike (default {NIC_GBPS:g})")
    parser.add_argument("--nics-per-node", type=int, default=None, metavar="N",
                        help="NICs per node, shared evenly by its GPUs: a GPU gets nic-gbps x N / gpus-per-node "
                             "(default: one NIC per GPU)")
    parser.add_argument("--gpus-per-node", type=int, default=GPUS_PER_NODE, metavar="N",
                        help=f"GPUs per node, trainer and engine nodes alike (default {GPUS_PER_NODE}); "
                             "read only with --nics-per-node")
    parser.add_argument("--host-us-per-tensor", type=float, default=HOST_US_PER_TENSOR, metavar="US",
                        help="a sender's host time per HF tensor the trainer pushes it, in microseconds (default "
                             f"{HOST_US_PER_TENSOR:g}: the bulk push, benchmarks/bench_push.py); 0 leaves it out")
    parser.add_argument("--host-device-gbps", type=float, default=HOST_DEVICE_GBPS,
                        help=f"sender host<->device copy bandwidth in GB/s (default {HOST_DEVICE_GBPS:g})")
    parser.add_argument("--slots", choices=("host", "gpu"), default="host",
                        help="where transfer-buffer slots live: host (bytes bounce through pinned host "
                             "memory, the default) or gpu (GPUDirect RDMA)")
    parser.add_argument("--production", choices=tuple(PRODUCTION_GBPS), default="loader",
                        help="how a sender fills slots: loader (sglang's loaders from Python; default "
                             f"{PRODUCTION_GBPS['loader']:g} GB/s, measured on an H200) or replay (recorded copy "
                             f"plans; default {PRODUCTION_GBPS['replay']:g} GB/s, a target, not measured)")
    parser.add_argument("--production-gbps", type=float, default=None,
                        help="a sender's slot production rate in GB/s, overriding --production's default")
    parser.add_argument("--gather-gbps", type=float, default=GATHER_GBPS,
                        help="the trainer's gather bandwidth in GB/s: each sender gathers its stage's full "
                             "tensors from its TP/EP/FSDP shards (default "
                             f"{GATHER_GBPS:g}, NVLink inside a node: assumed, not measured)")
    parser.add_argument("--changed-fraction", action="append", default=[], metavar="F[,F...]",
                        help="also predict delta updates where a fraction F of the elements changed since the "
                             "previous version (repeatable or a comma list, e.g. 0.01,0.03,0.1)")
    parser.add_argument("--detect-gbps", type=float, default=DETECT_GBPS,
                        help="a delta sender's change detection rate in GB/s of prepared bytes (default "
                             f"{DETECT_GBPS:g}: the host codec, one thread, measured on the H200 host at 1%% changed)")
    parser.add_argument("--apply-gbps", type=float, default=APPLY_GBPS,
                        help="an engine rank's delta apply rate in GB/s of the bytes its records cover (default "
                             f"{APPLY_GBPS:g}: the host codec, one thread, measured on the CPU VM at 1%% changed)")
    parser.add_argument("--apply-at-end", action="store_true",
                        help="model every delta record applied after the last write (P2PW_DELTA_APPLY_BESIDE=0); "
                             "default: each slot's applied beside the later writes, the last slot's left after them")
    parser.add_argument("--delta-area", type=float, default=AREA_FRACTION, metavar="FRACTION",
                        help="an engine rank's delta area as a fraction of its bytes (default 1/8, "
                             "P2PW_DELTA_AREA's default): records past it go as full writes")
    parser.add_argument("--engine-kind", choices=("sglang", "vllm"), default="sglang",
                        help="what the engines are: sglang (default; --engine takes sglang's server args) or vLLM "
                             "0.33 (--engine tp=..,dp=..,ep=..,moe_backend=..,deep_gemm=..: its layout, refused where "
                             "vLLM's post-processing rewrites the bytes; docs/vllm.md)")
    parser.add_argument("--join", type=int, default=0, metavar="N",
                        help="also price N more engines like the last one joining (sender.add_engines): the join "
                             "update and a full update after it")
    parser.add_argument("--json", action="store_true", help="print the plan and cost as JSON")


def run(args: argparse.Namespace) -> int:
    try:
        config = read_model(args.model)
        shape = model_shape(config)
        trainer = parse_trainer(args.trainer, pp_gathered=args.pp_gathered, split=args.split)
        engines = (parse_engines(args.engines, args.engine, shape) if args.engine_kind == "sglang" else
                   vllm_engines(engine_sizes(args.engines), args.engine, config))
        links = Links(nic_gbps=args.nic_gbps, host_device_gbps=args.host_device_gbps,
                      host_slots=args.slots == "host", production=args.production,
                      production_gbps=args.production_gbps, gather_gbps=args.gather_gbps,
                      host_us_per_tensor=args.host_us_per_tensor, nics_per_node=args.nics_per_node,
                      gpus_per_node=args.gpus_per_node)
        plan = make_plan(trainer, engines, shape, balanced=args.balanced)
        writers = trainer.senders_per_stage if trainer.split == "layers" else 1  # the writers of a stage's layers
        tensors = stage_tensor_counts(config, shape.layers, trainer.stages, writers) if links.host_us_per_tensor else None
        cost = predict(plan, shape, links, args.dtype, tensors)
        fractions = parse_fractions(args.changed_fraction)
        rates = DeltaRates(detect_gbps=args.detect_gbps, apply_gbps=args.apply_gbps, area_fraction=args.delta_area,
                           apply_beside=not args.apply_at_end)
        deltas = (predict_deltas(cost, fractions, delta_unit(shape, args.dtype), rates, not_built_yet(plan, links))
                  if fractions else None)
        join = (predict_join(args.join, trainer, engines, shape, links, args.dtype, tensors,
                             deltas.updates[0].p2p_seconds if deltas is not None else cost.p2p_seconds,
                             balanced=args.balanced) if args.join else None)
    except PlanError as e:
        print(f"p2pweights plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        doc = plan_json(args, shape, plan, cost, links, deltas)
        print(json.dumps({**doc, **({"join": join.as_json()} if join is not None else {})}))
    else:
        print(render(shape, plan, cost, links, args.dtype))
        if deltas is not None:
            print(render_deltas(deltas))
        if join is not None:
            print(render_join(join))
    return 0


def read_model(model: str) -> dict:
    """``--model``: a built-in name, a config folder or a config.json (the registry's one loader)."""
    try:
        return load_config(model)
    except UnknownModel as e:
        raise PlanError(f"--model: {e}") from None


def _key_values(text: str, flag: str, allowed: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in allowed:
            raise PlanError(f"{flag}: cannot read {item!r}; expected key=value with key one of {', '.join(allowed)}")
        out[key] = value
    return out


def _int(value: str, flag: str, key: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise PlanError(f"{flag}: {key}={value!r} is not a whole number") from None


def parse_trainer(text: str, *, pp_gathered: bool = False, split: str = "engine_ranks") -> TrainerLayout:
    """``tp=4,pp=4,ep=16,fsdp=2,gpus=64`` -> TrainerLayout."""
    kv = _key_values(text, "--trainer", ("tp", "pp", "ep", "fsdp", "gpus"))
    if "gpus" not in kv:
        raise PlanError("--trainer: gpus is required, e.g. --trainer tp=4,pp=4,gpus=64")
    n = {k: _int(v, "--trainer", k) for k, v in kv.items()}
    return TrainerLayout(gpus=n["gpus"], tp=n.get("tp", 1), pp=n.get("pp", 1), ep=n.get("ep", 1),
                         fsdp=n.get("fsdp", 1), pp_gathered=pp_gathered, split=split)


def parse_engines(engines: str, engine: str = "", shape: ModelShape | None = None) -> list[Engine]:
    """``3x4,1x2`` and ``tp=..,ep=..`` -> one Engine per engine, in order. ``tp`` defaults to each
    engine's GPU count; without fused_shared_experts, the cost model takes sglang's default for
    ``shape`` and the engine's EP."""
    try:
        args = parse_layout_spec(engine, command="plan", honours=PLAN_KEYS, why=_PLAN_READS)
    except P2PWeightsError as e:
        raise PlanError(str(e)) from None
    sizes = engine_sizes(engines)
    layouts: dict[int, EngineLayout] = {}
    for gpus in sizes:
        if gpus not in layouts:
            try:
                layouts[gpus] = EngineLayout.from_args({"tp_size": gpus, **args})
            except P2PWeightsError as e:
                raise PlanError(f"--engine: {e}") from None
    return [Engine(gpus=gpus, layout=layouts[gpus]) for gpus in sizes]


def engine_sizes(engines: str) -> list[int]:
    """``3x4,1x2`` -> each engine's GPU count, in order."""
    sizes: list[int] = []
    for item in filter(None, (s.strip() for s in engines.split(","))):
        count, sep, gpus = item.partition("x")
        if not sep:
            count, gpus = "1", item
        c, g = _int(count, "--engines", "count"), _int(gpus, "--engines", "gpus")
        if c < 1 or g < 1:
            raise PlanError(f"--engines: {item!r} has zero engines or zero GPUs; write COUNTxGPUS with both >= 1")
        sizes += [g] * c
    if not sizes:
        raise PlanError("--engines: no engines; give at least one, e.g. --engines 2x8")
    return sizes


def plan_json(args: argparse.Namespace, shape: ModelShape, plan: Plan, cost: Cost, links: Links,
              deltas: DeltaPlan | None = None) -> dict:
    t = plan.trainer
    doc = {
        "model": {"architecture": shape.architecture, "layers": shape.layers, "dtype": args.dtype,
                  "quantization": shape.fp8.describe() if shape.fp8 is not None else None},
        "trainer": {"gpus": t.gpus, "tp": t.tp, "pp": t.pp, "ep": t.ep, "fsdp": t.fsdp, "pp_gathered": t.pp_gathered,
                    "split": t.split},
        "engine_kind": getattr(args, "engine_kind", "sglang"),
        "engines": [{"engine": i, "gpus": e.gpus, "layout": layout_label(e.layout, shape)}
                    for i, e in enumerate(plan.engines)],
        "summary": {
            "pp_stages": t.stages,
            "senders_per_stage": t.senders_per_stage,
            "active_senders_per_stage": plan.active_senders_per_stage,
            "engine_ranks": plan.engine_ranks,
            "max_engine_ranks_per_sender": plan.max_engine_ranks_per_sender,
            "max_engines_per_sender": plan.max_engines_per_sender,
        },
        "senders": plan.senders_json(),
        "links": links.as_json(),
        "cost": cost.as_json(),
    }
    if deltas is not None:
        doc["delta"] = deltas.as_json()
    return doc


def weights_label(shape: ModelShape, dtype: str) -> str:
    """``bf16``, or ``fp8 128x128 blocks + float32 scales (rest bf16)`` for an FP8 config."""
    if shape.fp8 is None:
        return dtype
    bo, bi = shape.fp8.block
    return f"fp8 {bo}x{bi} blocks + float32 scales (rest {dtype})"


def _gb(n: int) -> str:
    return f"{n / 1e9:.3f} GB"


def render(shape: ModelShape, plan: Plan, cost: Cost, links: Links, dtype: str) -> str:
    t = plan.trainer
    layouts = sorted({layout_label(e.layout, shape) for e in plan.engines})
    lines = [
        f"model      {shape.architecture}, {shape.layers} layers, {weights_label(shape, dtype)}",
        f"trainer    {t.gpus} GPUs tp={t.tp} pp={t.pp} ep={t.ep}" + (f" fsdp={t.fsdp}" if t.fsdp > 1 else "")
        + (" (PP gathered)" if t.pp_gathered else "")
        + ("; each stage's layers split over its senders, each writing every engine rank" if t.split == "layers" else ""),
        f"engines    {len(plan.engines)} engines, {plan.engine_ranks} engine ranks; layouts: {'; '.join(layouts)}",
        f"senders    {t.senders_per_stage} per PP stage x {t.stages} stage(s); "
        f"{plan.active_senders_per_stage} per stage write",
        f"fan-out    a sender prepares at most {plan.max_engine_ranks_per_sender} engine rank(s) and makes at most "
        f"{plan.max_engines_per_sender} engine-rank write(s) per stage",
        f"links      {nic_label(links)}, host<->device {links.host_device_gbps:g} GB/s, "
        f"slots in {'host' if links.host_slots else 'GPU'} memory",
        f"sender     production {links.production} {links.production_rate:g} GB/s"
        + ("" if links.production_measured else " (target, not measured)")
        + f", trainer gather {links.gather_gbps:g} GB/s, {host_label(links, cost)}",
        "",
        f"{'quantity':<40} {'value':>14}",
        f"{'bytes per engine rank (max)':<40} {_gb(cost.bytes_per_engine_rank_max):>14}",
        f"{'bytes prepared per sender (max)':<40} {_gb(cost.bytes_prepared_per_sender_max):>14}",
        f"{'bytes written per sender (max)':<40} {_gb(cost.bytes_per_sender_max):>14}",
        f"{'bytes gathered per sender (max)':<40} {_gb(cost.bytes_gathered_per_sender_max):>14}",
        f"{'full model (broadcast per GPU)':<40} {_gb(cost.full_model_bytes):>14}",
    ]
    if cost.tensors_per_sender_max:
        lines.append(f"{'HF tensors pushed per sender (max)':<40} {cost.tensors_per_sender_max:>14,}")
    for link, seconds in cost.seconds_by_link:
        lines.append(f"{'  time on ' + link:<40} {seconds:>12.3f} s")
    lines += [
        f"{'P2P predicted':<40} {cost.p2p_seconds:>12.3f} s",
        f"{'broadcast predicted':<40} {cost.broadcast_seconds:>12.3f} s",
        f"{'wire floor':<40} {cost.floor_seconds:>12.3f} s",
        f"{'P2P / wire floor':<40} {cost.p2p_seconds / cost.floor_seconds:>13.2f}x",
        f"{'bottleneck':<40} {cost.bottleneck:>14}",
        f"{'speed-up over broadcast':<40} {cost.broadcast_seconds / cost.p2p_seconds:>13.1f}x",
    ]
    if cost.bottleneck == SENDER_HOST_PATH:
        lines.append(f"{'':<40} the sender's host path bounds it: {cost.tensors_per_sender_max:,} tensors x "
                     f"{links.host_us_per_tensor:g} us = {cost.host_path_seconds:.3f} s, above the wire floor")
    return "\n".join(lines)


def nic_label(links: Links) -> str:
    """``NIC 50 GB/s per GPU`` or ``NICs 4 x 50 GB/s per node of 8 GPUs = 25 GB/s per GPU``."""
    if links.nics_per_node is None:
        return f"NIC {links.nic_gbps:g} GB/s per GPU"
    return (f"NICs {links.nics_per_node} x {links.nic_gbps:g} GB/s per node of {links.gpus_per_node} GPUs "
            f"= {links.nic_per_gpu:g} GB/s per GPU")


def host_label(links: Links, cost: Cost) -> str:
    if not links.host_us_per_tensor:
        return "host path per tensor left out"
    if not cost.tensors_per_sender_max:
        return "host path per tensor not priced (no checkpoint schema for this architecture)"
    return f"host path {links.host_us_per_tensor:g} us per pushed tensor"


def render_deltas(d: DeltaPlan) -> str:
    """The delta updates' table: one column per changed fraction, beside the full update."""
    full, ups = d.full, d.updates
    w = 12

    def row(label: str, first: str, cells: list[str]) -> str:
        return f"{label:<40} {first:>{w}}" + "".join(f" {c:>{w}}" for c in cells)

    def gb(n: float) -> str:
        return f"{n / 1e9:.3f} GB"

    r = d.rates
    lines = [
        "",
        f"delta updates: {FIRST_FULL}",
        f"delta      units of {d.unit} byte(s) compared; change detection {r.detect_gbps:g} GB/s, "
        f"apply {r.apply_gbps:g} GB/s " + ("beside the writes" if r.apply_beside else "after the last write")
        + f"; delta area {r.area_fraction:g} of an engine rank's bytes",
    ]
    if r.measured_at_one_percent and any(u.changed_fraction not in (0.0, 0.01) for u in ups):
        lines.append("           (default rates measured at 1% changed: slower at higher F, faster at lower F)")
    if d.not_built:
        lines.append("not built  yet (such updates are written in full today):")
        lines += [f"           - {what}" for what in d.not_built]
    lines += [
        "",
        row("quantity", "full", [f"F={u.changed_fraction:g}" for u in ups]),
        row("record bytes / parameter bytes", "-", [f"{u.codec_ratio:.4f}" for u in ups]),
        row("bytes on the wire / full", "1.0000", [f"{u.wire_ratio:.4f}" for u in ups]),
        row("bytes per engine rank (max)", gb(full.bytes_per_engine_rank_max),
            [gb(u.bytes_per_engine_rank_max) for u in ups]),
        row("bytes written per sender (max)", gb(full.bytes_per_sender_max), [gb(u.bytes_per_sender_max) for u in ups]),
    ]
    full_s = dict(full.seconds_by_link)
    for k, (link, _) in enumerate(ups[0].seconds_by_link if ups else ()):
        first = f"{full_s[link]:.3f} s" if link in full_s else "-"
        lines.append(row(("  " if link.startswith("engine apply") else "  time on ") + link, first,
                         [f"{u.seconds_by_link[k][1]:.3f} s" for u in ups]))
    lines += [
        row("P2P predicted", f"{full.p2p_seconds:.3f} s", [f"{u.p2p_seconds:.3f} s" for u in ups]),
        row("delta / full", "1.00", [f"{u.p2p_seconds / full.p2p_seconds:.2f}" for u in ups]),
    ]
    lines += [f"{'bottleneck':<40} full: {full.bottleneck}"]
    lines += [f"{'':<40} F={u.changed_fraction:g}: {u.bottleneck}" for u in ups]
    lines += [
        f"{'sender memory for bases (max)':<40} {gb(d.base_bytes_per_sender_max):>{w}}  "
        "(a copy of every byte a sender prepares, in its slots' memory)",
        f"{'delta area per engine rank (max)':<40} {gb(d.area_bytes_per_engine_rank_max):>{w}}",
    ]
    return "\n".join(lines)
