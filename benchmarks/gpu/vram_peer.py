"""A receiver with one VRAM region, in its own process (the GPU benchmark's engine stand-in).

python vram_peer.py --transport nixl --size 1GiB  -> prints its publication (one JSON line), then
answers stdin lines: "check SEED" -> {"wrong_bytes": n}, "zero" -> {"ok": true}, "exit".
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from p2pweights.settings import parse_size
from p2pweights.transport import make_receiver_endpoint

GOLDEN = 0x1E3779B97F4A7C15


def pattern(nbytes: int, seed: int, offset: int = 0, device: str = "cuda") -> torch.Tensor:
    """Bytes [offset, offset + nbytes) of a seeded stream, made on the GPU (offset, nbytes: x8)."""
    words = torch.arange(offset // 8, (offset + nbytes) // 8, dtype=torch.int64, device=device)
    words = words * GOLDEN + (seed * 0x2545F4914F6CDD1 + 1)
    return words.view(torch.uint8)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--transport", required=True)
    p.add_argument("--size", default="1GiB")
    a = p.parse_args()
    n = parse_size(a.size)
    region = torch.zeros(n, dtype=torch.uint8, device="cuda")
    ep = make_receiver_endpoint(a.transport)
    ep.register(region.data_ptr(), n, "cuda:0")
    pub = ep.publication({"region": [region.data_ptr(), n, 1]}, rank=0)
    print(pub.to_json(), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "exit":
            break
        if cmd[0] == "check":
            torch.cuda.synchronize()
            wrong = int((region != pattern(n, int(cmd[1]))).sum())
            print(json.dumps({"wrong_bytes": wrong}), flush=True)
        elif cmd[0] == "zero":
            region.zero_()
            torch.cuda.synchronize()
            print(json.dumps({"ok": True}), flush=True)
    ep.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
