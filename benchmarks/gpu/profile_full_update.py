"""Where a steady full update on one GPU spends its time (issue 36, item 6), section ``full_profile``
of bench_gpu.py: Qwen3-4B into a VRAM receiver of ``tp=2`` over NIXL (cuda_ipc), GPU slots, pushed
with ``push_many``. One engine; senders one after another with other slot settings (count x bytes),
``steps`` steady steps each after a first full one (the trainer's tensors are made anew only for the
step that is checked: a ``delta=False`` update writes every byte whatever they hold). Then, at the
default slots, one steady step under torch.profiler (CUDA kernels, copies, memsets of the sender
process: NIXL's cuda_ipc copies are issued there): the device's busy time as the union of its
intervals, the idle gaps between them (largest first) and the share of the update's wall time the
device worked, and one under cProfile (the sender's host time by function). The last step of each
setting is checked byte for byte.

Rows: one per steady update (setting, report phases), then the timeline rows, then top functions.
"""
from __future__ import annotations

import json
import os
import tempfile
import time

#: (slots, bytes per slot): the default first
SETTINGS = ((2, 512 << 20), (4, 512 << 20), (2, 2 << 30), (8, 128 << 20))


def _intervals(trace_path: str) -> list[tuple[float, float, str]]:
    """(start µs, end µs, name) of every device activity in a torch.profiler chrome trace."""
    with open(trace_path) as f:
        events = json.load(f).get("traceEvents", [])
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            out.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)), f"{e['cat']}:{e.get('name', '')[:60]}"))
    return sorted(out)


def timeline_rows(trace_path: str, wall_s: float, label: str, top: int = 8) -> list[dict]:
    """The device's busy union, its first-to-last span, the largest idle gaps and busy time by kind."""
    spans = _intervals(trace_path)
    if not spans:
        return [{"timeline": label, "error": "no device activity in the trace"}]
    busy, gaps, (cur_s, cur_e) = 0.0, [], spans[0][:2]
    by_kind: dict[str, list[float]] = {}
    for s, e, name in spans:
        kind = name.split(":", 1)[0] + ":" + ("cuda_ipc/peer" if "PtoP" in name or "Peer" in name else name.split(":", 1)[1][:30])
        acc = by_kind.setdefault(kind, [0, 0.0])
        acc[0] += 1
        acc[1] += e - s
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_e - spans[0][0]))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    first, last = spans[0][0], max(e for _, e, _ in spans)
    rows = [{"timeline": label, "wall_s": wall_s, "device_span_s": (last - first) / 1e6, "device_busy_s": busy / 1e6,
             "busy_share_of_wall": busy / 1e6 / wall_s, "activities": len(spans), "gaps": len(gaps),
             "gaps_total_s": sum(g for g, _ in gaps) / 1e6}]
    for g, at in sorted(gaps, reverse=True)[:top]:
        rows.append({"timeline": label, "gap_ms": g / 1e3, "at_ms": at / 1e3})
    for kind, (n, t) in sorted(by_kind.items(), key=lambda kv: -kv[1][1])[:top]:
        rows.append({"timeline": label, "kind": kind, "count": n, "device_ms": t / 1e3})
    return rows


def section_full_profile(model: str = "qwen3-4b", spec: str = "tp=2", steps: int = 4,
                         settings: tuple = SETTINGS, profiled: bool = True) -> list[dict]:
    import cProfile

    import torch
    from cprofile_rows import top_functions
    from torch.profiler import ProfilerActivity, profile

    from p2pweights.control import SglangEngine
    from p2pweights.models import resolve_model
    from p2pweights.models.checkpoint import random_tensor, trainer_tensors
    from p2pweights.receiver import check_weights_equal, start_engine
    from p2pweights.sender import WeightSender

    cfg = resolve_model(model)
    specs = trainer_tensors(cfg)
    rows: list[dict] = []
    engine = start_engine(cfg, spec, transport="nixl", name="vram-engine", env={"P2PW_RECEIVER_DEVICE": "cuda:0"},
                          startup_timeout=600)
    version = 0
    try:
        for n_slots, size in settings:
            sender = WeightSender(cfg, transport="nixl", buffer_device="cuda", num_slots=n_slots, buffer_size=size)
            sender.connect([SglangEngine(engine.url, name="vram-engine")])
            if getattr(sender, "recorder", None) is not None:
                sender.recorder.wait()
            traced = profiled and (n_slots, size) == settings[0]
            plan = ["first"] + ["steady"] * steps + (["torch", "cprofile"] if traced else [])
            tensors: list = []
            for i, how in enumerate(plan):
                version += 1
                last = i == len(plan) - 1
                if last or not tensors:  # only a checked step needs its version's bytes (delta=False writes all)
                    tensors = [(n, random_tensor(n, s, version).to("cuda")) for n, s in specs.items()]
                    seed = version
                torch.cuda.synchronize()
                prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if how == "torch" else None
                host = cProfile.Profile() if how == "cprofile" else None
                if prof is not None:
                    prof.__enter__()
                if host is not None:
                    host.enable()
                t0 = time.perf_counter()
                with sender.update(version, delta=False) as u:
                    u.push_many(tensors)
                wall = time.perf_counter() - t0
                if host is not None:
                    host.disable()
                if prof is not None:
                    prof.__exit__(None, None, None)
                r = u.report
                equal = bool(check_weights_equal(engine.url, hf_seed=seed)["success"]) if last else None
                rows.append({"slots": n_slots, "slot_mib": size >> 20, "step": how, "seconds": r.seconds,
                             "wall_s": wall, "data_s": r.data_seconds, "writing_s": r.writing_seconds,
                             "waiting_s": r.waiting_seconds, "loading_s": r.loading_seconds,
                             "staging_s": r.staging_seconds, "control_s": r.control_seconds, "n_slots": r.slots,
                             "bytes": r.bytes, "equal": equal})
                if prof is not None:
                    path = os.path.join(tempfile.mkdtemp(prefix="p2pw-trace-"), "trace.json")
                    prof.export_chrome_trace(path)
                    rows += timeline_rows(path, wall, f"{n_slots}x{size >> 20} MiB steady")
                if host is not None:
                    rows += top_functions(host, 15)
            del tensors
            sender.close()
    finally:
        engine.close()
    return rows
