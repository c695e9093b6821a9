"""FP8 block quantization on the GPU: bytes identical to the CPU's, and throughput.

Run on the GPU machine from the repository root with p2pweights importable::

    python3 benchmarks/gpu/bench_fp8.py [--json OUT.json]

1. Identity: for random BF16 weights of several shapes (edge blocks, a zero block, tiny and large
   magnitudes), plain and ue8m0 scales, the CUDA result's bytes equal the CPU result's (`#wrong` 0).
2. Throughput, GB/s of BF16 input: one 2048×7168 expert matrix, and a Kimi-K2-shaped expert layer
   (384 experts × w1, w3 [2048, 7168] and w2 [7168, 2048]) quantized tensor by tensor.
"""
from __future__ import annotations

import argparse
import json

import torch
from bench_gpu import gbps, timed  # this folder's GPU bench: best of N, synchronized

from p2pweights.sender.fp8 import quantize_block_fp8


def _weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    for rows, cols in ((128, 128), (300, 200), (2048, 7168), (7168, 2048), (129, 4097)):
        w = torch.randn(rows, cols, generator=g) * (10.0 ** torch.randint(-6, 3, (1,), generator=g).item())
        if rows >= 256 and cols >= 256:
            w[:128, :128] = 0  # an all-zero block
            w[128:256, :128] *= 1e-30  # a block of tiny values
        yield f"{rows}x{cols}", w.to(torch.bfloat16)


def identity() -> list[dict]:
    rows = []
    for seed in range(3):
        for name, w in _weights(seed):
            for fmt in (None, "ue8m0"):
                q_cpu, s_cpu = quantize_block_fp8(w, scale_fmt=fmt)
                q_gpu, s_gpu = quantize_block_fp8(w.cuda(), scale_fmt=fmt)
                wrong = int((q_cpu.view(torch.uint8) != q_gpu.cpu().view(torch.uint8)).sum())
                wrong += int((s_cpu.view(torch.int32) != s_gpu.cpu().view(torch.int32)).sum())
                rows.append({"shape": name, "seed": seed, "scale_fmt": fmt or "float32", "#wrong": wrong})
    return rows


def throughput() -> list[dict]:
    out = []
    w = torch.randn(2048, 7168, device="cuda").to(torch.bfloat16)
    s = timed(lambda: quantize_block_fp8(w))
    out.append({"case": "one expert matrix 2048x7168", "bytes": w.numel() * 2, "seconds": s,
                "gbps": gbps(w.numel() * 2, s)})
    layer = [torch.randn(2048, 7168, device="cuda").to(torch.bfloat16) for _ in range(384 * 2)]
    layer += [torch.randn(7168, 2048, device="cuda").to(torch.bfloat16) for _ in range(384)]
    nbytes = sum(t.numel() * 2 for t in layer)
    s = timed(lambda: [quantize_block_fp8(t) for t in layer], repeat=3)
    out.append({"case": "Kimi-K2 expert layer (384 x w1, w3, w2)", "bytes": nbytes, "seconds": s,
                "gbps": gbps(nbytes, s)})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    a = p.parse_args()
    ident = identity()
    wrong = sum(r["#wrong"] for r in ident)
    print("shape       seed  scales   #wrong")
    for r in ident:
        print(f"{r['shape']:<11} {r['seed']:>4}  {r['scale_fmt']:<7}  {r['#wrong']}")
    print(f"# CPU vs CUDA: {'OK' if wrong == 0 else 'FAILED'} ({wrong} differing bytes/scales)")
    tp = throughput()
    print("case                                       bytes           seconds   GB/s")
    for r in tp:
        print(f"{r['case']:<42} {r['bytes']:>14,}  {r['seconds']:.4f}  {r['gbps']:.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"identity": ident, "throughput": tp, "device": torch.cuda.get_device_name()}, f, indent=1)
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
