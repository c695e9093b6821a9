"""FP8 block quantization on the GPU: bytes identical to the CPU's, and throughput of quantize-on-send.

Run on the GPU machine from the repository root with p2pweights importable::

    python3 benchmarks/gpu/bench_fp8.py [--json OUT.json]

1. Identity: for random BF16 weights of several shapes (edge blocks, a zero block, tiny and large
   magnitudes), plain and ue8m0 scales, the CUDA result's bytes equal the CPU result's (`#wrong` 0),
   tensor by tensor and batched (``quantize_many`` on CUDA against the CPU's per-tensor call).
2. Throughput, GB/s of BF16 input (target: >= 100 GB/s, a 400 Gb/s NIC's 50 GB/s of FP8 output):
   a. a Kimi-K2 expert layer (384 experts x w1, w3 [2048, 7168] and w2 [7168, 2048], 33.8 GB):
      tensor by tensor, and batched as the sender's transform does it (``QuantizeOnSend``: one
      ``quantize_many`` call per shape, ``max_batch_bytes`` of input per call of the formula);
   b. a full DeepSeek-V3 TP8/EP8 engine rank's worth of groups (what one sender quantizes for one
      engine rank: every attention, dense-MLP and shared-expert weight in full, since each TP rank's
      loaders take the full HF tensor, and the rank's 32 routed experts of each of the 58 MoE
      layers), group by group through ``QuantizeOnSend``, and tensor by tensor.
   Every throughput case checks its output bytes against the per-tensor call on some weights.

``--device cpu --small`` runs a shrunken version on a CPU (a smoke test of the script itself).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu import gbps  # noqa: E402 - this folder's GPU bench

from p2pweights.models import load_config, resolve_model  # noqa: E402
from p2pweights.models.checkpoint import trainer_tensors  # noqa: E402
from p2pweights.models.fp8_format import quantize_block_fp8  # noqa: E402
from p2pweights.models.quant import quant_scheme  # noqa: E402
from p2pweights.sender.fp8 import quantize_many  # noqa: E402
from p2pweights.sender.quantize import QuantizeOnSend  # noqa: E402

GiB = 1 << 30


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(fn, device: str, repeat: int) -> float:
    import time

    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _same(a, b) -> int:
    """Differing bytes of two (fp8, scale) results (0: identical)."""
    (qa, sa), (qb, sb) = a, b
    wrong = int((qa.cpu().view(torch.uint8) != qb.cpu().view(torch.uint8)).sum())
    return wrong + int((sa.cpu().view(torch.int32) != sb.cpu().view(torch.int32)).sum())


# -- 1. identity ------------------------------------------------------------------------------------
def _weights(seed: int, small: bool):
    g = torch.Generator().manual_seed(seed)
    shapes = ((128, 128), (300, 200), (129, 4097)) + (() if small else ((2048, 7168), (7168, 2048)))
    for rows, cols in shapes:
        w = torch.randn(rows, cols, generator=g) * (10.0 ** torch.randint(-6, 3, (1,), generator=g).item())
        if rows >= 256 and cols >= 256:
            w[:128, :128] = 0  # an all-zero block
            w[128:256, :128] *= 1e-30  # a block of tiny values
        yield f"{rows}x{cols}", w.to(torch.bfloat16)


def identity(device: str, small: bool) -> list[dict]:
    rows = []
    for seed in range(3):
        for name, w in _weights(seed, small):
            for fmt in (None, "ue8m0"):
                cpu = quantize_block_fp8(w, scale_fmt=fmt)
                wrong = _same(cpu, quantize_block_fp8(w.to(device), scale_fmt=fmt))
                rows.append({"case": "per tensor", "shape": name, "seed": seed, "scale_fmt": fmt or "float32",
                             "#wrong": wrong})
        for fmt in (None, "ue8m0"):  # a stack of experts with edge blocks, batched on the device
            ws = [w for k in range(4) for n, w in _weights(10 * seed + k + 10, True) if n == "129x4097"]
            batched = quantize_many([w.to(device) for w in ws], scale_fmt=fmt, max_batch_bytes=3 * ws[0].nbytes)
            wrong = sum(_same(quantize_block_fp8(w, scale_fmt=fmt), b) for w, b in zip(ws, batched))
            rows.append({"case": "batched", "shape": f"4 x {tuple(ws[0].shape)}", "seed": seed,
                         "scale_fmt": fmt or "float32", "#wrong": wrong})
    return rows


# -- 2a. a Kimi-K2 expert layer ----------------------------------------------------------------------
def kimi_layer(device: str, small: bool, repeat: int) -> list[dict]:
    cfg = load_config(resolve_model("kimi-k2-fp8"))
    scheme = quant_scheme(cfg)
    experts = 8 if small else int(cfg["n_routed_experts"])
    inter, hidden = (256, 512) if small else (int(cfg["moe_intermediate_size"]), int(cfg["hidden_size"]))
    layer = {}
    for e in range(experts):
        for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)), ("down_proj", (hidden, inter))):
            layer[f"model.layers.1.mlp.experts.{e}.{proj}.weight"] = torch.randn(shape, device=device).to(torch.bfloat16)
    nbytes = sum(t.nbytes for t in layer.values())
    names = list(layer)
    out = []
    s = _timed(lambda: [quantize_block_fp8(layer[n], scheme.block, scheme.scale_fmt, name=n) for n in names],
               device, repeat)
    out.append({"case": f"Kimi-K2 expert layer ({experts} x w1,w3,w2), per tensor", "bytes": nbytes,
                "seconds": s, "gbps": gbps(nbytes, s), "#wrong": 0})
    probe = names[:3] + names[-3:]
    for batch in (256 << 20, 1 * GiB, 4 * GiB):
        def run(batch=batch):
            return QuantizeOnSend(scheme, max_batch_bytes=batch).quantize(layer)
        s = _timed(run, device, repeat)
        made = run()
        wrong = sum(_same(made[n], quantize_block_fp8(layer[n], scheme.block, scheme.scale_fmt)) for n in probe)
        out.append({"case": f"Kimi-K2 expert layer, batched ({batch >> 20} MiB per call)", "bytes": nbytes,
                    "seconds": s, "gbps": gbps(nbytes, s), "#wrong": wrong})
    return out


# -- 2b. a DeepSeek-V3 TP8/EP8 engine rank ----------------------------------------------------------
def deepseek_rank_groups(ep: int = 8, rank: int = 0, small: bool = False) -> list[dict[str, tuple]]:
    """HF name -> shape of each group's weights that quantize-on-send makes FP8, for one engine rank
    of DeepSeek-V3 at TP8/EP8 (attention/dense/shared weights in full, the rank's routed experts)."""
    cfg = load_config(resolve_model("deepseek-v3-fp8"))
    scheme = quant_scheme(cfg)
    layers = 5 if small else int(cfg["num_hidden_layers"])  # the MTP layer (61) is not the target's
    per_rank = int(cfg["n_routed_experts"]) // ep
    groups: dict[tuple, dict[str, tuple]] = defaultdict(dict)
    for name, spec in trainer_tensors(cfg).items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m is None or int(m[1]) >= layers or not scheme.quantizes(name, spec.shape):
            continue
        expert = re.search(r"\.experts\.(\d+)\.", name)
        if expert is not None and int(expert[1]) // per_rank != rank:
            continue  # another EP rank's expert
        kind = "experts" if expert else "shared" if "shared_experts" in name else (
            "attn" if "self_attn" in name else "mlp")
        groups[(int(m[1]), kind)][name] = spec.shape
    return list(groups.values())


def deepseek_rank(device: str, small: bool, repeat: int) -> list[dict]:
    scheme = quant_scheme(load_config(resolve_model("deepseek-v3-fp8")))
    groups = deepseek_rank_groups(small=small)
    if small:  # the real shapes are too large for a CPU smoke test: divide every dimension by 16
        groups = [{n: tuple(max(1, d // 16) for d in s) for n, s in g.items()} for g in groups]
    pool: dict[tuple, torch.Tensor] = {}  # (shape, k): the k-th weight of that shape in a group, reused

    def tensors(group: dict[str, tuple]) -> dict[str, torch.Tensor]:
        seen: dict[tuple, int] = defaultdict(int)
        out = {}
        for name, shape in group.items():
            key = (shape, seen[shape])
            seen[shape] += 1
            if key not in pool:
                pool[key] = torch.randn(shape, device=device).to(torch.bfloat16)
            out[name] = pool[key]
        return out

    for g in groups:  # the pool is allocated before timing
        tensors(g)
    nbytes = sum(2 * torch.Size(s).numel() for g in groups for s in g.values())
    count = sum(len(g) for g in groups)

    def per_tensor():
        for g in groups:
            for n, t in tensors(g).items():
                quantize_block_fp8(t, scheme.block, scheme.scale_fmt, name=n)

    def batched():
        transform = QuantizeOnSend(scheme)
        for g in groups:
            transform.quantize(tensors(g))

    out = []
    for label, fn in (("per tensor", per_tensor), ("QuantizeOnSend, batched per group", batched)):
        s = _timed(fn, device, repeat)
        out.append({"case": f"DeepSeek-V3 TP8/EP8 rank 0 ({len(groups)} groups, {count} weights), {label}",
                    "bytes": nbytes, "seconds": s, "gbps": gbps(nbytes, s), "#wrong": 0})
    experts = next(g for g in groups if len(g) > 8)
    made = QuantizeOnSend(scheme).quantize(tensors(experts))
    out[-1]["#wrong"] = sum(_same(made[n], quantize_block_fp8(t, scheme.block, scheme.scale_fmt))
                            for n, t in list(tensors(experts).items())[:4])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="shrunken shapes (a CPU smoke test)")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    ident = identity(a.device, a.small)
    wrong = sum(r["#wrong"] for r in ident)
    print(f"{'case':<10}  {'shape':<20} {'seed':>4}  {'scales':<7}  #wrong")
    for r in ident:
        print(f"{r['case']:<10}  {r['shape']:<20} {r['seed']:>4}  {r['scale_fmt']:<7}  {r['#wrong']}")
    print(f"# CPU vs {a.device}: {'OK' if wrong == 0 else 'FAILED'} ({wrong} differing bytes/scales)\n")
    tp = kimi_layer(a.device, a.small, a.repeat) + deepseek_rank(a.device, a.small, a.repeat)
    bad = sum(r["#wrong"] for r in tp)
    print(f"{'case':<92} {'bytes':>16}  {'seconds':>8}  {'GB/s':>7}  #wrong")
    for r in tp:
        print(f"{r['case']:<92} {r['bytes']:>16,}  {r['seconds']:8.4f}  {r['gbps']:7.2f}  {r['#wrong']}")
    print(f"# batched vs per tensor: {'OK' if bad == 0 else 'FAILED'}; GB/s of BF16 input, best of {a.repeat}")
    device = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
    result = {"device": device, "identity": ident, "throughput": tp, "ok": wrong == 0 and bad == 0}
    print(json.dumps(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
