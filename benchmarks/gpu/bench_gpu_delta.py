"""GPU delta updates (issue 24), sections of bench_gpu.py (``update_delta``, ``update_delta_fp8``):
whole updates into a VRAM receiver with their byte-for-byte checks, the change detection alone and
an engine rank's apply alone."""
from __future__ import annotations

import time


def section_update_delta(model: str = "qwen3-4b", spec: str = "tp=2", fraction: float = 0.01,
                         steps: int = 3) -> list[dict]:
    """Delta updates (issue 24): GPU slots, NIXL, into a VRAM receiver, every step checked byte for
    byte. Version 0 of a changed family (full: the first update), versions 1..steps (``fraction`` of
    the elements changed: deltas), the last version again with delta=False (a steady full update, same
    run), then two fresh checkpoints (every element new) with delta="auto" and delta=False. Then the
    change detection alone on one 256 MiB slot of BF16 (``index_records.find_changes``)."""
    from p2pweights.models import resolve_model
    from p2pweights.models.checkpoint import trainer_tensors

    cfg = resolve_model(model)
    rows = []
    engine, sender = vram_engine_and_sender(cfg, spec)
    try:
        for label, delta, r, _, equal in delta_steps(engine, sender, trainer_tensors(cfg), fraction, steps):
            rows.append({"model": model, "engine": spec, "update": label, "delta": str(delta), "bytes": r.bytes,
                         "bytes_written": r.bytes_written, "written_ratio": r.bytes_written / r.bytes,
                         "seconds": r.seconds, "data_s": r.data_seconds, "control_s": r.control_seconds,
                         "loading_s": r.loading_seconds, "writing_s": r.writing_seconds,
                         "staging_s": r.staging_seconds, "waiting_s": r.waiting_seconds,
                         "verbs_ms": {k: round(v * 1e3, 1) for k, v in r.control.items()}, "changed_bytes": r.changed_bytes,
                         "base_bytes": r.base_bytes, "reasons": sorted(set(r.delta_reason.values())),
                         "equal": equal})
        sender.close()
    finally:
        engine.close()
    return rows + detection_rows() + engine_apply_rows()


def delta_steps(engine, sender, specs, fraction: float, steps: int, *, bulk: bool = True, device: str = "cuda"):
    """The delta family's updates, each checked byte for byte: version 0 (full: the first update),
    versions 1..``steps`` (``fraction`` changed: deltas), the last again with delta=False (a steady
    full update, same run), a fresh checkpoint with delta="auto" and another with delta=False.
    ``device``: where the trainer's tensors live (``cpu`` runs the family on a host without a GPU).
    Yields (label, delta, report, wall seconds of the update, equal)."""
    import torch

    from p2pweights.models.checkpoint import random_tensor
    from p2pweights.receiver import check_weights_equal

    plan = [("v0", (fraction, 0), "auto")] + [(f"v{k}", (fraction, k), "auto") for k in range(1, steps + 1)]
    plan += [(f"v{steps} again", (fraction, steps), False), ("fresh 1", 101, "auto"), ("fresh 2", 102, False)]
    for label, version, delta in plan:
        changed = version if isinstance(version, tuple) else None
        seed = 7 if changed else version
        tensors = [(n, random_tensor(n, s, seed, changed=changed).to(device)) for n, s in specs.items()]
        if device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with sender.update(label, delta=delta) as u:
            if bulk:
                u.push_many(tensors)
            else:
                for n, t in tensors:
                    u.push(n, t)
        wall = time.perf_counter() - t0
        del tensors
        check = check_weights_equal(engine.url, hf_seed=seed, changed_fraction=changed[0] if changed else None,
                                    changed_steps=changed[1] if changed else None)
        yield label, delta, u.report, wall, bool(check["success"])


def vram_engine_and_sender(cfg: str, spec: str):
    """A VRAM receiver of ``spec`` on cuda:0 over NIXL and a connected sender with GPU slots whose
    background copy plans are recorded (a trainer trains between connect and its first update).
    The caller closes both."""
    from p2pweights.control import SglangEngine
    from p2pweights.receiver import start_engine
    from p2pweights.sender import WeightSender

    engine = start_engine(cfg, spec, transport="nixl", name="vram-engine",
                          env={"P2PW_RECEIVER_DEVICE": "cuda:0", "P2PW_DELTA_AREA": str(512 << 20)},  # a GPU area is sized
                          startup_timeout=600)
    try:
        sender = WeightSender(cfg, transport="nixl", buffer_device="cuda")
        sender.connect([SglangEngine(engine.url, name="vram-engine")])
        if getattr(sender, "recorder", None) is not None:
            sender.recorder.wait()
    except BaseException:
        engine.close()
        raise
    return engine, sender


def detection_rows(slot: int = 256 << 20, runs: int = 10) -> list[dict]:
    """The change detection alone (``index_records.find_changes``) on one slot of BF16 against a base
    that differs in a fraction of its elements (restored before each timed call, untimed): the
    kernels of delta_find.cu against the torch path, same run."""
    import torch

    from p2pweights.deltas import index_records, kernels

    cur = torch.randn(slot // 2, device="cuda").bfloat16().view(torch.uint8)
    rows = []
    for fraction in (0.0, 0.01, 0.1, 1.0):
        template = cur.clone()
        if fraction:
            step = max(1, round(1 / fraction))
            template.view(torch.int16)[::step] += 1
        base = template.clone()
        for use_kernels in (True, False):
            kernels.ENABLED = use_kernels
            seconds = []
            try:
                for k in range(runs + 2):
                    base.copy_(template)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    found = index_records.find_changes(cur, base, [(0, 0, slot)], 2)
                    torch.cuda.synchronize()
                    if k >= 2:
                        seconds.append(time.perf_counter() - t0)
                exact = bool(torch.equal(base, cur))
            finally:
                kernels.ENABLED = True
            best = sorted(seconds)[len(seconds) // 2]
            rows.append({"change_detection": "kernels" if use_kernels else "torch", "fraction": fraction,
                         "slot_bytes": slot, "changed": found.count, "median_s": best,
                         "gbps": slot / best / 1e9, "base_equal_after": exact})
    return rows


def engine_apply_rows(weight_bytes: int = 4 << 30, slot: int = 256 << 20, writers: int = 1,
                      repeats: int = 1, unit: int = 2) -> list[dict]:
    """An engine rank's apply alone, in this process: 1% of a rank's BF16 elements changed, one index
    record per 256 MiB slot in a GPU delta area (as a sender writes them), then ``DeltaArea.apply``:
    the host walk and checks, the device checks, the scatters. Checked equal after. ``writers``: the
    slots split over that many writers (PP stages), each writing its records into its own part of the
    area and naming them in its own segment. ``repeats``: the "again" run that many times (best kept).
    ``unit``: 2 (BF16 elements) or 1 (FP8: 1% of the bytes changed, twice the stores per byte)."""
    import hashlib

    import torch

    from p2pweights.deltas import index_records
    from p2pweights.deltas.area import PREFIX, DeltaArea, Manifest, writer_part

    weights = torch.randn(weight_bytes // 2, device="cuda").bfloat16().view(torch.uint8)
    new = weights.clone()
    (new.view(torch.int16) if unit == 2 else new.view(torch.int8))[::100] += 1
    base = weights.clone()
    area = DeltaArea(weight_bytes // 8, device="cuda")
    slots = list(range(0, weight_bytes, slot))
    segments, records = [], 0
    for w in range(writers):
        start = cursor = writer_part(area.nbytes, w, writers)[0]
        digest, checks, offsets = hashlib.sha256(), [], []
        for at in slots[w * len(slots) // writers:(w + 1) * len(slots) // writers]:
            found = index_records.find_changes(new, base, [(at, at, slot)], unit)
            nrec = index_records.record_bytes(1, found.count, unit)
            head = PREFIX.pack(0, nrec) + index_records.header_and_table(found, [(0, slot // unit, weights.data_ptr() + at)])
            offsets.append(cursor)
            area.tensor[cursor:cursor + len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8).cuda()
            checks.append(index_records.write_payload(found, area.tensor[cursor + len(head):cursor + PREFIX.size + nrec]))
            digest.update(head)
            cursor += PREFIX.size + nrec
            records += 1
        digest.update(index_records.checksum_words(checks))
        segments.append(Manifest(cursor - start, len(offsets), digest.hexdigest(), tuple(offsets), start))
    del base
    torch.cuda.synchronize()
    rows = []
    for run in ("first", *["again"] * repeats):  # the first pays CUDA's lazy kernel loading; again: re-applied
        t0 = time.perf_counter()
        figures = area.apply(segments, [(weights.data_ptr(), weight_bytes)], [weights])
        seconds = time.perf_counter() - t0
        rows.append({"engine_apply_weight_bytes": weight_bytes, "run": run, "records": records, "writers": writers,
                     "unit": unit,
                     "area_bytes": sum(m.bytes for m in segments), "seconds": seconds, "check_s": figures["check_s"],
                     "apply_s": figures["apply_s"], "device_reads": figures["device_reads"],
                     "covered_gbps": weight_bytes / seconds / 1e9, "equal": bool(torch.equal(weights, new))})
    area.close()
    return rows
