"""Where a steady GPU delta update spends its time (issue 24), section ``delta_profile`` of bench_gpu.py:
the same engine, sender and checkpoints as ``update_delta`` (Qwen3-4B TP2 into a VRAM receiver over
NIXL, GPU slots), v0 full, v1 a delta (warm), then v2 (1% changed) and the same version again with
``delta=False`` each under torch.profiler (CUDA kernels and copies: how long the device was busy, and
with what, against the update's wall time), and v3 under cProfile (the sender's host time by
function). Every step checked byte for byte.

Rows: one per profiled update (wall, device busy, the top device activities by time) and the top
host functions of v3 by own time.
"""
from __future__ import annotations

import time


def _device_rows(prof, label: str, wall: float, top: int = 12) -> list[dict]:
    """The device's activities of one profiled update: their summed time (busy) and the top ones."""
    events = [e for e in prof.key_averages() if getattr(e, "device_time_total", 0) > 0
              and not e.key.startswith("ProfilerStep")]
    # torch's kernel and memcpy events have no CPU self time; the ops that launched them double count
    device = [e for e in events if getattr(e, "self_device_time_total", 0) > 0]
    busy = sum(e.self_device_time_total for e in device) / 1e6
    rows = [{"profile": label, "wall_s": wall, "device_busy_s": busy, "device_idle_share": max(0.0, 1 - busy / wall)}]
    for e in sorted(device, key=lambda e: -e.self_device_time_total)[:top]:
        rows.append({"profile": label, "activity": e.key[:90], "calls": e.count,
                     "device_ms": e.self_device_time_total / 1e3})
    return rows


def section_delta_profile(model: str = "qwen3-4b", spec: str = "tp=2", fraction: float = 0.01) -> list[dict]:
    import cProfile

    import torch
    from bench_gpu_delta import vram_engine_and_sender
    from cprofile_rows import top_functions
    from torch.profiler import ProfilerActivity, profile

    from p2pweights.models import resolve_model
    from p2pweights.models.checkpoint import random_tensor, trainer_tensors
    from p2pweights.receiver import check_weights_equal

    cfg = resolve_model(model)
    rows: list[dict] = []
    engine, sender = vram_engine_and_sender(cfg, spec)
    try:
        specs = trainer_tensors(cfg)
        plan = [("v0", 0, "auto", None), ("v1", 1, "auto", None), ("v2 delta", 2, "auto", "torch"),
                ("v2 again, delta=False", 2, False, "torch"), ("v3 delta", 3, "auto", "cprofile")]
        host = None
        for label, k, delta, how in plan:
            tensors = [(n, random_tensor(n, s, 7, changed=(fraction, k)).to("cuda")) for n, s in specs.items()]
            torch.cuda.synchronize()
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if how == "torch" else None
            if how == "cprofile":
                host = cProfile.Profile()
                host.enable()
            if prof is not None:
                prof.__enter__()
            t0 = time.perf_counter()
            with sender.update(label, delta=delta) as u:
                for n, t in tensors:
                    u.push(n, t)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            if prof is not None:
                prof.__exit__(None, None, None)
            if how == "cprofile":
                host.disable()
            r = u.report
            equal = bool(check_weights_equal(engine.url, hf_seed=7, changed_fraction=fraction,
                                             changed_steps=k)["success"])
            rows.append({"update": label, "seconds": r.seconds, "data_s": r.data_seconds,
                         "staging_s": r.staging_seconds, "writing_s": r.writing_seconds,
                         "waiting_s": r.waiting_seconds, "loading_s": r.loading_seconds,
                         "written_ratio": r.bytes_written / r.bytes, "slots": r.slots, "equal": equal})
            if prof is not None:
                rows += _device_rows(prof, label, wall)
            del tensors
        sender.close()
        if host is not None:
            rows += top_functions(host, 25)
    finally:
        engine.close()
    return rows + detection_profile()


def detection_profile(slot: int = 256 << 20, runs: int = 5) -> list[dict]:
    """The change detection of one 256 MiB BF16 slot (``index_records.find_changes``, as
    bench_gpu_delta.detection_rows) under torch.profiler at 0 and 1% changed: each kernel's time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from p2pweights.deltas import index_records

    cur = torch.randn(slot // 2, device="cuda").bfloat16().view(torch.uint8)
    rows: list[dict] = []
    for fraction in (0.0, 0.01):
        template = cur.clone()
        if fraction:
            template.view(torch.int16)[::round(1 / fraction)] += 1
        base = template.clone()
        for _ in range(2):
            index_records.find_changes(cur, base, [(0, 0, slot)], 2)
            base.copy_(template)
        torch.cuda.synchronize()
        wall = 0.0
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(runs):
                base.copy_(template)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                index_records.find_changes(cur, base, [(0, 0, slot)], 2)
                torch.cuda.synchronize()
                wall += time.perf_counter() - t0
        rows += _device_rows(prof, f"detection {fraction:.0%} x{runs}", wall)
    return rows
