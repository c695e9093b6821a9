"""`p2pweights demo`: engines and senders on this machine; K updates with P2P and with broadcast."""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..models.engine_layout import EngineLayout
from ..settings import format_size, parse_size, value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen3-0.6b",
                   help="built-in shape (qwen3-0.6b, qwen3-4b, qwen3-30b-a3b, deepseek-v3, deepseek-v3-fp8-tiny: FP8, "
                        "quantized on send) or a config dir; random weights, no download (default: %(default)s)")
    p.add_argument("--engine-kind", choices=("receiver", "sglang", "vllm"), default="receiver",
                   help="what the engines are: receiver (p2pweights' receiver processes, each rank a real sglang "
                        "model class in host memory), sglang (real sglang servers, python -m "
                        "sglang.launch_server on the CPU with the p2pweights plugin, publishing over Mooncake TCP; "
                        "--engine tp=N only, transport mooncake, checked by sglang's own /weights_checker "
                        "checksums) or vllm (stand-in vLLM 0.33 engines: vLLM's CPU worker, routes and the p2pweights "
                        "gate, docs/vllm.md; tp=1, transport mooncake, p2p only, checked by vLLM's /weight_checker "
                        "checksums against a fresh vLLM load) (default: %(default)s)")
    p.add_argument("--engines", type=int, default=2, help="engines to start (default: %(default)s)")
    p.add_argument("--engine", default=None,
                   help="each engine's layout: tp=..,ep=..,dp_attention=..[,<sglang server arg>=<value>]; a key "
                        "that does not decide a rank's bytes is refused (default: tp=2; tp=1 with --engine-kind vllm)")
    p.add_argument("--senders", type=int, default=2, help="sender processes, the trainer's data replicas (default: %(default)s)")
    p.add_argument("--steps", type=int, default=2, help="updates per mode (default: %(default)s)")
    p.add_argument("--changed-fraction", type=_fraction, default=None, metavar="F",
                   help="each step's weights differ from the previous step's in a fraction F of the elements, "
                        "uniformly spread, as an RL step changes them (step k: version k of one seed's changed "
                        "family; the equality check asks for the same version); the rows show the bytes written "
                        "next to a full update's (default: off, a fresh random checkpoint per step)")
    p.add_argument("--transport", choices=("mooncake", "nixl", "auto"), default=None,
                   help="P2P transport; auto: nixl where its native C-API path loads (no GIL on the write path; "
                        "UCX shared memory on one host: each byte copied once, where Mooncake's TCP copies it twice "
                        "in the kernel), else mooncake (default: P2PW_TRANSPORT when set, else auto)")
    p.add_argument("--modes", default=None,
                   help="comma-separated: p2p, broadcast (default: p2p,broadcast; p2p for an FP8 model: the gloo "
                        "broadcast baseline has no float8 type)")
    p.add_argument("--buffer-size", default=None, help="bytes per transfer slot (default: P2PW_BUFFER_SIZE, else 512MiB)")
    p.add_argument("--verify", nargs="?", const="on", default="off", choices=("off", "on", "alternate"),
                   help="P2P updates with verify=True (engine ranks digest what they hold, the senders compare); "
                        "'alternate': every second step, to measure its cost in one run (default: %(default)s)")
    p.add_argument("--no-check", action="store_true", help="skip the byte-for-byte equality check after each step")
    p.add_argument("--verbose", action="store_true",
                   help="print every sender's update report (stage times, per engine rank) and the transports' own logs")
    p.add_argument("--churn", action="store_true",
                   help="the engine set changes between steps (restart, join, down, back, leave: commands/demo_churn.py) "
                        "while one sender updates; one row per engine and step (receiver engines only)")
    p.add_argument("--lora", type=int, default=None, metavar="R",
                   help="update a LoRA adapter of rank R instead of the weights: receiver engines with sglang's LoRA "
                        "pool load it once, then each step writes it one-sided into its slot (step 1 whole, later "
                        "steps the changed blocks); one row per step with the bytes a merged update would move "
                        "(commands/demo_lora.py, docs/lora.md; receiver engines only)")
    p.add_argument("--json", action="store_true", help='print {"steps": [...]} as JSON (progress goes to stderr)')


def _fraction(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        f = -1.0
    if not 0.0 <= f <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return f


def pick_transport(name: str) -> tuple[str, str]:
    """(transport, why) for --transport, by the one rule of ``transport.resolve_transport`` ("auto":
    nixl where NIXL's native C-API sender path loads, else mooncake); why is " (auto: ...)", "" for
    an explicit name."""
    from ..transport import resolve_transport

    name, why = resolve_transport(name)
    return name, f" ({why})" if why else ""


def _default_transport() -> str:
    """P2PW_TRANSPORT (default ``auto``: on one host the demo's writes cross loopback, where NIXL's
    shared memory beats Mooncake's TCP, docs/transports.md)."""
    return value("P2PW_TRANSPORT")


def _churn(args: argparse.Namespace, model: str, transport: str, why: str, overrides: dict, out: Any,
           progress: Any) -> int:
    """--churn (commands/demo_churn.py): receiver engines only, one in-process sender."""
    from dataclasses import asdict

    from .demo_churn import HEADER, run_churn_demo

    if args.engine_kind != "receiver":
        raise SystemExit(f"--churn: --engine-kind {args.engine_kind} is not built; the churn demo restarts and kills "
                         f"engines as receiver processes (--engine-kind receiver)")
    progress(f"p2pweights demo --churn: model {args.model}, {args.engines} receiver engine(s) x {args.engine} + 1 "
             f"joining, transport {transport}{why}")
    progress(HEADER)
    rows = run_churn_demo(model, engines=args.engines, engine=args.engine, transport=transport,
                          changed_fraction=args.changed_fraction, check=not args.no_check, overrides=overrides,
                          progress=progress)
    if args.json:
        print(json.dumps({"churn": [asdict(r) for r in rows]}, indent=2), file=sys.stdout)
    return 0 if all(r.equal is not False for r in rows) else 1


def _lora(args: argparse.Namespace, model: str, transport: str, why: str, out: Any, progress: Any) -> int:
    """--lora R (commands/demo_lora.py): receiver engines only, one in-process sender."""
    from dataclasses import asdict

    from .demo_lora import HEADER, run_lora_demo

    if args.engine_kind != "receiver":
        raise SystemExit(f"--lora: --engine-kind {args.engine_kind} is not built in the demo; use --engine-kind "
                         f"receiver (tests/test_sglang_plugin_lora.py and tests/test_vllm_adapter_update.py run the others)")
    if args.lora < 1:
        raise SystemExit(f"--lora: the adapter's rank must be 1 or more, got {args.lora}")
    progress(f"p2pweights demo --lora {args.lora}: model {args.model}, {args.engines} receiver engine(s) x "
             f"{args.engine}, {args.steps} step(s), transport {transport}{why}")
    progress(HEADER)
    rows = run_lora_demo(model, rank=args.lora, engines=args.engines, engine=args.engine, transport=transport,
                         steps=args.steps, changed_fraction=args.changed_fraction, check=not args.no_check,
                         verify=args.verify == "on", progress=progress)
    if args.json:
        print(json.dumps({"lora": [asdict(r) for r in rows]}, indent=2), file=sys.stdout)
    return 0 if all(r.equal is not False for r in rows) else 1


def run(args: argparse.Namespace) -> int:
    from ..errors import UnsupportedLayout
    from ..models import UnknownModel, load_config, resolve_model
    from ..models.quant import quant_scheme
    from .demo_run import results_json, run_demo

    # refused here, before any engine starts: an unknown model, an --engine key the engines
    # would not honour (both raise a P2PWeightsError: one line, exit code 2)
    try:
        model = resolve_model(args.model)
    except UnknownModel as e:
        raise UnknownModel(f"--model: {e}") from None
    sglang, vllm = args.engine_kind == "sglang", args.engine_kind == "vllm"
    args.engine = args.engine or ("tp=1" if vllm else "tp=2")
    fp8 = quant_scheme(load_config(model)) is not None
    if vllm:
        from . import demo_vllm

        if fp8:
            raise UnsupportedLayout(f"--model {args.model}: --engine-kind vllm: {demo_vllm.WHY_NO_FP8}")
        demo_vllm.require_vllm()
        demo_vllm.engine_layout(args.engine)
        transport, why = demo_vllm.pick_transport(args.transport or _default_transport())
    elif sglang:
        from . import demo_sglang

        if fp8:
            raise UnsupportedLayout(f"--model {args.model}: --engine-kind sglang takes BF16 models only: sglang's "
                                    f"checksum hashes FP8 weights dequantized, which the demo's check does not "
                                    f"reproduce, and no FP8 model was run on the CPU platform; use --engine-kind "
                                    f"receiver")
        demo_sglang.engine_layout(args.engine, load_config(model))
        transport, why = demo_sglang.pick_transport(args.transport or _default_transport())
    else:
        EngineLayout.parse(args.engine, command="demo")
        transport, why = pick_transport(args.transport or _default_transport())
    modes = [m for m in (args.modes or ("p2p" if fp8 or vllm else "p2p,broadcast")).split(",") if m]
    unknown = set(modes) - {"p2p", "broadcast"}
    if unknown:
        raise SystemExit(f"--modes: unknown mode(s) {', '.join(sorted(unknown))}; use p2p and/or broadcast")
    if vllm:
        demo_vllm.refuse_modes(modes)  # vLLM's own broadcast baseline needs NCCL on GPUs
    if fp8 and "broadcast" in modes:
        raise SystemExit(f"--modes broadcast: {args.model} is FP8 block-quantized and the broadcast baseline's gloo "
                         f"group has no float8 type; use --modes p2p")
    overrides = {"buffer_size": parse_size(args.buffer_size)} if args.buffer_size else {}
    out = sys.stderr if args.json else sys.stdout

    def progress(line: str) -> None:
        print(line, file=out, flush=True)

    if args.churn:
        return _churn(args, model, transport, why, overrides, out, progress)
    if args.lora is not None:
        return _lora(args, model, transport, why, out, progress)
    changed = f", {args.changed_fraction:g} of the elements changed per step" if args.changed_fraction is not None else ""
    progress(f"p2pweights demo: model {args.model}, {args.engines} {args.engine_kind} engine(s) x {args.engine}, "
             f"{args.senders} sender(s), {args.steps} step(s){changed}, transport {transport}{why}, "
             f"modes {','.join(modes)}")
    run_kind = demo_vllm.run_vllm_demo if vllm else demo_sglang.run_sglang_demo if sglang else run_demo
    results = run_kind(model, engines=args.engines, engine=args.engine, senders=args.senders, steps=args.steps,
                       transport=transport, modes=modes, check=not args.no_check, overrides=overrides,
                       progress=progress, verbose=args.verbose, verify=args.verify,
                       changed_fraction=args.changed_fraction)
    if args.json:
        print(json.dumps(results_json(results), indent=2))
    else:
        print()
        reasons = any(r.delta_reason for r in results)  # the column only when an engine rank got a full write
        print(f"{'mode':>9}  {'transport':>9}  {'step':>4}  {'bytes/engine rank':>17}  {'bytes written':>13}  "
              f"{'seconds':>8}  {'GB/s':>6}  equal  {'sender CPU s':<12}" + ("  full write because" if reasons else ""))
        for r in results:
            eq = {True: "yes", False: "NO", None: "-"}[r.equal]
            cpu = "/".join(f"{c:.2f}" for c in r.sender_cpu_seconds) or "-"  # per sender process, P2P only
            print(f"{r.label:>9}  {r.transport:>9}  {r.step:>4}  {format_size(r.bytes):>17}  "
                  f"{format_size(r.bytes_written):>13}  {r.seconds:8.3f}  {r.gbps:6.2f}  {eq:>5}  {cpu:<12}"
                  + (f"  {r.delta_reason or '-'}" if reasons else ""))
        verified = [r.seconds for r in results if r.verified]
        plain = [r.seconds for r in results if r.mode == "p2p" and not r.verified]
        if verified and plain:
            v, s = sum(verified) / len(verified), sum(plain) / len(plain)
            print(f"\np2p mean {s:.3f} s unverified vs {v:.3f} s verified: verify=True costs {v - s:+.3f} s "
                  f"({(v / s - 1) * 100:+.0f}%)")
            if (any(r.verified and r.bytes_written == r.bytes and r.delta_reason for r in results)
                    and any(r.mode == "p2p" and not r.verified and r.bytes_written < r.bytes for r in results)):
                # a group of senders writes verified updates in full (docs/deltas.md): not verify's cost alone
                print("  (the verified steps wrote in full, the others deltas: the difference is not verify's alone)")
        by_mode = {}
        for r in results:
            if not r.verified:
                by_mode.setdefault(r.mode, []).append(r.seconds)
        if "p2p" in by_mode and "broadcast" in by_mode:
            p2p, bc = min(by_mode["p2p"]), min(by_mode["broadcast"])
            print(f"\nbest p2p {p2p:.3f} s vs best broadcast {bc:.3f} s: p2p takes {p2p / bc:.2f}x the broadcast time")
    ok = all(r.equal is not False for r in results)
    return 0 if ok else 1
