"""The GPU copy programs' host side, and the batched copy kernel's own source, without a GPU.

tests/fake_cuda/ builds a stand-in libcuda.so.1 whose "device" pointers are host pointers and whose
cuLaunchKernel runs csrc/kernels/copy_batch.cu compiled for the host, block by block and thread by
thread. A fresh Python process finds it first on LD_LIBRARY_PATH, so the native module's driver
path runs for real: descriptor checks, the batches of 64 copies the kernel takes as its parameter,
chunks, unit widths (16 down to 1 byte, misaligned addresses, 2-D copies with negative pitches, zero
fills), lanes forked and joined. Every mode must write the bytes a plain Python loop writes, and a
failing driver call must come back as DEVICE_ERROR. The real GPU runs are benchmarks/bench_replay.py
on the H200 (benchmarks/RESULTS.md).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent

SCRIPT = r'''
import ctypes, json, random, sys
import numpy as np, torch
from p2pweights import _native
fake = ctypes.CDLL("libcuda.so.1")
info = _native.cuda_driver_info()
random.seed(int(sys.argv[1]))
srcs = [torch.randint(0, 255, (1 << 20,), dtype=torch.uint8), torch.randint(0, 255, (300001,), dtype=torch.uint8)]

def program():
    rows, off = [], 0
    for _ in range(random.choice([1, 63, 64, 65, 150])):
        kind = random.random()
        if kind < 0.15:  # a zero fill, 1-D or 2-D
            rb, n = random.choice([1, 3, 16, 4096]), random.choice([1, 1, 3])
            rows.append([-1, off, 0, rb, n, rb + 16, 0]); off += (rb + 16) * n
        elif kind < 0.4:  # 2-D: a column shard; a source read backwards
            rb, n = random.choice([2, 7, 16, 48]), random.randint(2, 40)
            dp, sp = rb + random.choice([0, 5, 16]), random.choice([rb, rb + 32, -rb])
            rows.append([0 if sp < 0 else random.choice([0, 1]), off, 5000 if sp < 0 else random.randint(0, 999),
                         rb, n, dp, sp]); off += dp * n
        else:  # 1-D, some past a 64 KiB chunk, some misaligned
            rb = random.choice([16, 64, 1000, 65536 + 48, 200000])
            rows.append([0 if rb > 100000 else random.choice([0, 1]), off + random.choice([0, 3]),
                         random.choice([0, 1, 16]), rb, 1, rb, rb]); off += rb + 3
        off = (off + 15) // 16 * 16 + random.choice([0, 8])
    return np.array(rows, dtype=np.int64), off + 64

def expected(rows, n):
    out = torch.full((n,), 0xA5, dtype=torch.uint8)
    for inp, d, s, rb, k, dp, sp in rows.tolist():
        for r in range(k):
            out[d + r * dp:d + r * dp + rb] = 0 if inp < 0 else srcs[inp][s + r * sp:s + r * sp + rb]
    return out

results = []
for trial in range(4):
    rows, n = program()
    want = expected(rows, n)
    for mode, lanes in (("each", 1), ("each", 8), ("kernel", 1)):
        before = [fake.fake_count(i) for i in range(7)]
        slot = torch.full((n,), 0xA5, dtype=torch.uint8)
        code, msg, calls = _native.run_copy_program_cuda(rows, slot.data_ptr(), n, [s.data_ptr() for s in srcs],
                                                         [s.numel() for s in srcs], 0, mode, lanes)
        after = [fake.fake_count(i) for i in range(7)]
        results.append({"copies": len(rows), "mode": mode, "lanes": lanes, "code": code, "message": msg,
                        "equal": bool(torch.equal(slot, want)), "delta": [a - b for a, b in zip(after, before)]})
    # a descriptor past the slot: refused before any launch, nothing written
    slot = torch.full((n,), 0xA5, dtype=torch.uint8)
    bad = rows.copy(); bad[-1, 1] = n
    code, msg, _ = _native.run_copy_program_cuda(bad, slot.data_ptr(), n, [s.data_ptr() for s in srcs],
                                                 [s.numel() for s in srcs], 0, "kernel", 1)
    results.append({"forged": True, "code": code, "message": msg, "untouched": bool((slot == 0xA5).all())})
# the device fails the kernel launch, then every cuMemcpyAsync: a device error each time, not a transport one
failed = []
for call, mode in ((3, "kernel"), (0, "each")):
    fake.fake_fail(call)
    code, msg, _ = _native.run_copy_program_cuda(rows[rows[:, 4] == 1], slot.data_ptr(), n, [s.data_ptr() for s in srcs],
                                                 [s.numel() for s in srcs], 0, mode, 1)
    failed.append({"mode": mode, "code": code, "message": msg})
fake.fake_fail(-1)
code, msg, _ = _native.run_copy_program_cuda(rows, slot.data_ptr(), n, [], [], 0, "batch", 1)
print(json.dumps({"info": info, "results": results, "failed": failed, "batch": [code, msg],
                  "device_error": int(_native.Code.DEVICE_ERROR)}))
'''


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the stand-in driver")
    out = tmp_path_factory.mktemp("fake_cuda")
    subprocess.run([cxx, "-O1", "-shared", "-fPIC", str(HERE / "fake_cuda" / "fake_driver.cpp"),
                    str(HERE / "fake_cuda" / "kernel_on_host.cpp"), "-o", str(out / "libcuda.so.1")], check=True)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_every_gpu_copy_mode_writes_the_planned_bytes(fake_driver, seed):
    env = {**os.environ, "LD_LIBRARY_PATH": f"{fake_driver}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    run = subprocess.run([sys.executable, "-c", SCRIPT, str(seed)], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    info, results = out["info"], out["results"]
    assert info["loaded"] and info["lanes"] and "batch" not in info, info
    for r in results:
        if r.get("forged"):
            assert r["code"] != 0 and "writes up to byte" in r["message"] and r["untouched"], r
            continue
        assert r["code"] == 0 and r["equal"], r
        memcpy, copy2d, memset, launches, entries, streams, waits = r["delta"]
        if r["mode"] == "kernel" and info["kernel"]:  # one launch per 64 copies, every copy in one
            assert launches == -(-r["copies"] // 64) and entries == r["copies"] and memcpy + copy2d + memset == 0, r
        elif r["lanes"] > 1 and r["copies"] > 1:  # forked onto lanes, each joined back
            assert waits == 2 * min(r["lanes"], r["copies"]) and launches == 0, r
    for f in out["failed"]:
        if f["mode"] == "kernel" and not info["kernel"]:
            continue  # built without nvcc: kernel mode runs as driver copies, which do not fail here
        assert f["code"] == out["device_error"] and "unspecified launch failure" in f["message"], f
    # cuMemcpyBatchAsync is gone (no benchmark row justified it): the mode is refused, not run
    assert out["batch"][0] == -1 and "kernel or each" in out["batch"][1], out["batch"]
