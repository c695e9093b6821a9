"""The GPU path on one H200: pinned bandwidth, slot production, write paths, full updates into VRAM.

    source scripts/gpu_env.sh && python benchmarks/gpu/bench_gpu.py [--sections ...] [--out FILE]

Sections (each isolated: a failure is recorded and the next one runs):
  bandwidth   pinned (cudaHostRegister'ed transfer slots) and pageable D2H / H2D, 1 GiB copies
  production  the replica's loaders filling slots from GPU HF tensors: host slots and GPU slots,
              Qwen3-0.6B (TP1) and Qwen3-4B (TP2 rank 0) shapes; bytes of loaded slots per second
  writes      our pipelined writer into a VRAM region of another process: NIXL (GPU slots, host
              slots) and Mooncake (host slots, GPU slots); every byte checked
  update      full WeightSender updates into a VRAM receiver (Qwen3-4B shapes, TP2 engine on the same
              GPU, GPU slots, NIXL); last step checked byte for byte against sglang's loader
  update_fp8  FP8 engines (deepseek-v3-fp8-tiny; kimi-k2-fp8 cut to 2 layers x 32 experts): BF16 GPU
              tensors quantized on send, every step checked byte for byte
  profile     cProfile of one GPU-slot fill (Qwen3-4B TP2 rank 0): where the loaders' CPU time goes
  update_profile  the update section with its last step under cProfile (top functions by own time)
  detection   the change detection alone (one 256 MiB slot at 0/1/10/100% changed; kernels, torch)
  floor       item 6's floor: a device-to-device copy (one GiB, torch) and our pipelined NIXL writer
              VRAM -> VRAM at the sender's default 512 MiB slots and at 64 MiB, 4 GiB, every byte checked
  update_wire_small  update_wire's four (transport, slots) pairs, NIXL first, on Qwen3-0.6B TP1
  delta_profile  a steady delta and a full update under torch.profiler, a delta under cProfile
              (profile_gpu_delta.py)
  full_profile  steady full updates at other slot counts and sizes, one under torch.profiler (the
              device's busy union and idle gaps) and one under cProfile (profile_full_update.py)
  connect     benchmarks/profile_connect.py: each phase of a cold, warm, new-sender and disk-cache
              connect (Qwen3-4B TP2 VRAM receiver, NIXL, GPU slots), imports timed apart
Prints one table per section and writes all rows as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import bench_gpu_delta  # noqa: E402  (beside this file)
import bench_gpu_wire  # noqa: E402
import profile_full_update  # noqa: E402
import profile_gpu_delta  # noqa: E402
from cprofile_rows import top_functions  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(HERE))
GiB = 1 << 30


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def timed(fn, repeat: int = 5) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


# -- sections ----------------------------------------------------------------------------------------
def section_bandwidth() -> list[dict]:
    import torch

    from p2pweights.sender.buffers import TransferBuffers

    rows = []
    dev = torch.randint(0, 255, (GiB,), dtype=torch.uint8, device="cuda")
    with TransferBuffers(GiB, 1, pin="auto") as b:
        host = b.slot_tensor(0)
        pin = b.pin_mode
        d2h = timed(lambda: host.copy_(dev, non_blocking=True))
        h2d = timed(lambda: dev.copy_(host, non_blocking=True))
        ok = bool(torch.equal(host[:1 << 20].cuda(), dev[:1 << 20]))
        rows.append({"path": f"D2H into a transfer slot ({pin})", "bytes": GiB, "seconds": d2h, "gbps": gbps(GiB, d2h), "ok": ok})
        rows.append({"path": f"H2D from a transfer slot ({pin})", "bytes": GiB, "seconds": h2d, "gbps": gbps(GiB, h2d), "ok": ok})
    pageable = torch.empty(GiB, dtype=torch.uint8)
    d2h = timed(lambda: pageable.copy_(dev), repeat=3)
    rows.append({"path": "D2H pageable", "bytes": GiB, "seconds": d2h, "gbps": gbps(GiB, d2h), "ok": True})
    return rows


def section_floor() -> list[dict]:
    """What a steady full update on one GPU cannot beat: each byte is copied into a slot on the device
    and written out of it by NIXL (cuda_ipc on one GPU). The D2D copy rate bounds the first; the
    pipelined writer with the copy in its loop (``writes``) both at once."""
    import torch

    n = GiB
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    sec = timed(lambda: b.copy_(a))
    rows = [{"path": "D2D copy (torch, 1 GiB)", "bytes": n, "seconds": sec, "gbps": gbps(n, sec),
             "ok": bool(torch.equal(a[:1 << 20], b[:1 << 20]))}]
    for slot in (512 << 20, 64 << 20):
        rows += [r for r in section_writes(4 * GiB, slot, transports=("nixl",), devices=("cuda",))]
    for piece in (16 << 20, 4 << 20, 1 << 20):  # Qwen3-4B TP2: ~700 writes of ~11 MiB per update
        rows += [r for r in section_writes(4 * GiB, 512 << 20, transports=("nixl",), devices=("cuda",), piece=piece)]
    return rows


def _replica_and_inputs(model: str, spec: str, rank: int):
    import torch

    from p2pweights.models import resolve_model
    from p2pweights.models.checkpoint import random_tensor
    from p2pweights.replica import EngineLayout, model_replicas

    cfg = resolve_model(model)
    rep = model_replicas().get(cfg, EngineLayout.parse(spec), rank)
    needed = {n for g in rep.groups for n in g.hf_names}
    inputs = {n: random_tensor(n, s, 1).to("cuda") for n, s in rep.hf_specs.items() if n in needed}
    torch.cuda.synchronize()
    return rep, inputs


def pack_and_load(rep, inputs, slot_bytes: int, target, after=None, chunk: int | None = None, slot_done=None) -> None:
    """As the sender does it: groups packed into slots in order, one loader call per slot (or, with
    ``chunk``, per about that many bytes: the sender's staged slots). ``target(slot)`` is the tensor
    the loaders write; ``after(slot, start, end)`` runs after each call with the range it filled;
    ``slot_done(slot)`` when a slot is complete."""
    s, off, start, placed = 0, 0, 0, []

    def load() -> None:
        nonlocal placed, start
        if not placed:
            return
        rep.load_groups(placed, {n: inputs[n] for g, _ in placed for n in g.hf_names}, target(s))
        if after is not None:
            after(s, start, off)
        placed, start = [], off

    for g in rep.groups:
        if off + g.nbytes > slot_bytes:
            load()
            if slot_done is not None:
                slot_done(s)
            s, off, start = 1 - s, 0, 0
        placed.append((g, off))
        off = -(-(off + g.nbytes) // 256) * 256
        if chunk is not None and off - start >= chunk:
            load()
    load()
    if slot_done is not None:
        slot_done(s)


def section_production() -> list[dict]:
    import torch

    from p2pweights.sender.buffers import TransferBuffers, slot_size
    from p2pweights.sender.gpu_staging import GpuStaging

    rows = []
    for model, spec in (("qwen3-0.6b", "tp=1"), ("qwen3-4b", "tp=2")):
        rep, inputs = _replica_and_inputs(model, spec, 0)
        total = sum(g.nbytes for g in rep.groups)
        for device in ("cpu", "cuda"):
            with TransferBuffers(slot_size(512 << 20, rep.largest_group_nbytes), 2, device=device) as b:
                slots = [b.slot_tensor(i) for i in range(2)]

                def fill_all() -> None:
                    pack_and_load(rep, inputs, b.slot_bytes, lambda s: slots[s])

                sec = timed(fill_all, repeat=3)
            rows.append({"model": model, "engine": spec, "slots": device, "bytes": total, "groups": len(rep.groups),
                         "seconds": sec, "gbps": gbps(total, sec)})
        # host slots through the sender's GPU staging (staging.py): the loaders write a GPU buffer in
        # quarter-slot batches, the asynchronous D2H of each overlaps the next batch's loaders
        with TransferBuffers(slot_size(512 << 20, rep.largest_group_nbytes), 2, device="cpu") as b:
            staging = GpuStaging(b.slot_bytes, "cuda")
            slots = [b.slot_tensor(i) for i in range(2)]

            def fill_staged() -> None:
                current = {}

                def target(s):
                    if s not in current:
                        current[s] = staging.target()
                    return current[s]

                def slot_done(s):
                    staging.advance()
                    current.pop(s, None)

                pack_and_load(rep, inputs, b.slot_bytes, target, chunk=b.slot_bytes // 4, slot_done=slot_done,
                              after=lambda s, start, end: staging.copy_out(slots[s], start, end))
                staging.synchronize()

            sec = timed(fill_staged, repeat=3)
            staging = None  # its GPU buffers go before the next model's
        rows.append({"model": model, "engine": spec, "slots": "cpu via GPU staging", "bytes": total,
                     "groups": len(rep.groups), "seconds": sec, "gbps": gbps(total, sec)})
        inputs = None
        torch.cuda.empty_cache()
    return rows


def section_profile(model: str = "qwen3-4b", spec: str = "tp=2", top: int = 30) -> list[dict]:
    """Where GPU-slot production spends its CPU time (cProfile of one fill, sorted by own time)."""
    import cProfile

    import torch

    from p2pweights.sender.buffers import TransferBuffers, slot_size

    rep, inputs = _replica_and_inputs(model, spec, 0)
    with TransferBuffers(slot_size(512 << 20, rep.largest_group_nbytes), 2, device="cuda") as b:
        slots = [b.slot_tensor(i) for i in range(2)]
        pack_and_load(rep, inputs, b.slot_bytes, lambda s: slots[s])
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        pack_and_load(rep, inputs, b.slot_bytes, lambda s: slots[s])
        torch.cuda.synchronize()
        prof.disable()
        wall = time.perf_counter() - t0
    return [{"wall_s": wall}] + top_functions(prof, top)


def section_writes(size: int = GiB, slot: int = 64 << 20, transports=("nixl", "mooncake"),
                   devices=("cuda", "cpu"), piece: int | None = None) -> list[dict]:
    """``piece``: each slot written as writes of that many bytes (an update's slot holds many
    parameters, each its own write), else one write per slot."""

    from p2pweights.sender.buffers import TransferBuffers
    from p2pweights.sender.writer import PipelinedWriter
    from p2pweights.transport import make_sender_transport
    from p2pweights.transport.publication import EnginePublication

    sys.path.insert(0, HERE)
    from vram_peer import pattern

    rows = []
    for transport in transports:
        try:
            peer = subprocess.Popen([sys.executable, os.path.join(HERE, "vram_peer.py"), "--transport", transport,
                                     "--size", str(size)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            pub = EnginePublication.from_json(peer.stdout.readline())
            remote = pub.params["region"].data_ptr
            tr = make_sender_transport(transport)
            for device in devices:
                with TransferBuffers(slot, 2, device=device) as b:
                    tr.register_memory(b.address, b.total_bytes, b.location)
                    tr.connect(0, pub.descriptor)
                    w = PipelinedWriter(tr, b, transfer_timeout=60)
                    w.add_engine(0, "vram-peer", pub.regions)
                    src = pattern(size, 7)
                    slots = [b.slot_tensor(i) for i in range(2)]

                    def run() -> float:
                        t0 = time.perf_counter()
                        for c in range(size // slot):
                            s = w.acquire()
                            slots[s].copy_(src[c * slot:(c + 1) * slot], non_blocking=False)
                            step = piece or slot
                            w.submit(s, [(o, step, 0, remote + c * slot + o) for o in range(0, slot, step)])
                        w.finish()
                        return time.perf_counter() - t0

                    run()
                    sec = min(run() for _ in range(3))
                    peer.stdin.write("check 7\n")
                    peer.stdin.flush()
                    wrong = json.loads(peer.stdout.readline())["wrong_bytes"]
                    peer.stdin.write("zero\n")
                    peer.stdin.flush()
                    peer.stdout.readline()
                    w.close()
                    tr.disconnect(0)
                    tr.deregister_memory(b.address)
                rows.append({"transport": transport, "path": f"{'VRAM' if device == 'cuda' else 'pinned DRAM'} -> VRAM",
                             "bytes": size, "slot": slot, "writes_per_slot": slot // (piece or slot),
                             "seconds": sec, "gbps": gbps(size, sec), "wrong_bytes": wrong})
            tr.close()
            peer.stdin.write("exit\n")
            peer.stdin.flush()
            peer.wait(timeout=30)
        except Exception as e:  # noqa: BLE001
            rows.append({"transport": transport, "error": f"{type(e).__name__}: {e}"})
    return rows


def section_tests() -> list[dict]:
    """tests/test_gpu.py under pytest, here."""
    test = os.path.join(ROOT, "tests", "test_gpu.py")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                          capture_output=True, text=True, cwd=os.path.join(ROOT, "tests"), timeout=600)
    return [{"pytest": (proc.stdout or proc.stderr).strip().splitlines()[-1], "rc": proc.returncode}]


def section_update(model: str = "qwen3-4b", spec: str = "tp=2", steps: int = 5, buffer_device: str = "cuda",
                   profile: bool = False, check_every: bool = False) -> list[dict]:
    import torch

    from p2pweights.control import SglangEngine
    from p2pweights.models import resolve_model
    from p2pweights.models.checkpoint import random_tensor, trainer_tensors
    from p2pweights.receiver import check_weights_equal, start_engine
    from p2pweights.sender import WeightSender

    cfg = model if isinstance(model, dict) else resolve_model(model)
    model = model.get("_name", "config") if isinstance(model, dict) else model
    rows = []
    engine = start_engine(cfg, spec, transport="nixl", name="vram-engine",
                          env={"P2PW_RECEIVER_DEVICE": "cuda:0", "P2PW_DELTA_AREA": str(512 << 20)},  # a GPU area is sized
                          startup_timeout=600)
    try:
        specs = trainer_tensors(cfg)  # what a trainer holds: BF16 (an FP8 engine's are quantized on send)
        sender = WeightSender(cfg, transport="nixl", buffer_device=buffer_device)
        t0 = time.perf_counter()
        sender.connect([SglangEngine(engine.url, name="vram-engine")])
        connect_s = time.perf_counter() - t0
        # a trainer trains between connect and its first update: the background recorder's time
        t0 = time.perf_counter()
        if getattr(sender, "recorder", None) is not None:
            sender.recorder.wait()
        record_s = time.perf_counter() - t0
        for step in range(1, steps + 1):
            tensors = [(n, random_tensor(n, s, step).to("cuda")) for n, s in specs.items()]
            torch.cuda.synchronize()
            prof = None
            if profile and step == steps:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            with sender.update(step) as u:
                u.push_many(tensors)  # the bulk path, as a trainer calls it
            if prof is not None:
                prof.disable()
            r = u.report
            equal = None
            if step == steps or check_every:
                equal = bool(check_weights_equal(engine.url, hf_seed=step)["success"])
            rows.append({"model": model, "engine": spec, "slots": buffer_device, "step": step, "bytes": r.bytes,
                         "seconds": r.seconds, "data_s": r.data_seconds,
                         "gbps": r.gbps, "loading_s": r.loading_seconds, "writing_s": r.writing_seconds,
                         "waiting_s": r.waiting_seconds, "staging_s": r.staging_seconds, "control_s": r.control_seconds,
                         "n_slots": r.slots, "connect_s": connect_s, "background_record_s": record_s,
                         "replayed_groups": getattr(r, "replayed_groups", None),
                         "loader_groups": getattr(r, "loader_groups", None),
                         "equal": equal})
            del tensors
        sender.close()
        if profile:
            rows += top_functions(prof, 25)
    finally:
        engine.close()
    return rows


def fp8_config(layers: int = 2, experts: int = 32) -> str:
    """kimi-k2-fp8 cut to ``layers`` decoder layers (one dense) of ``experts`` routed experts, no MTP:
    the real hidden/expert/vocab sizes and FP8 128x128 blocks, small enough to build and check."""
    from p2pweights.models import load_config

    cfg = load_config("kimi-k2-fp8")
    cfg.update(num_hidden_layers=layers, n_routed_experts=experts, num_nextn_predict_layers=0)
    folder = f"/tmp/p2pw-kimi-k2-fp8-{layers}l-{experts}e"
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return folder


def section_update_fp8() -> list[dict]:
    """FP8 engines: BF16 GPU tensors quantized on send (sender's GPU), GPU slots, NIXL, into a VRAM
    receiver; every step checked byte for byte. The tiny built-in, then Kimi-K2-sized layers."""
    rows = section_update("deepseek-v3-fp8-tiny", "tp=2,ep=2", steps=2, check_every=True)
    return rows + section_update(fp8_config(), "tp=2,ep=2", steps=2, check_every=True)


def section_connect(model: str = "qwen3-4b", spec: str = "tp=2") -> list[dict]:
    """benchmarks/profile_connect.py in this (fresh) process: the phases of a cold and warm connects
    to a VRAM receiver over NIXL, GPU slots; torch and sglang imports timed apart."""
    sys.path.insert(0, os.path.dirname(HERE))
    import profile_connect

    result = profile_connect.profile(model, spec, "nixl", "cuda:0", "cuda")
    print(profile_connect.table(result), file=sys.stderr)
    return profile_connect.rows(result)


SECTIONS = {"floor": section_floor, "bandwidth": section_bandwidth, "production": section_production, "writes": section_writes,
            "update": section_update, "update_host_slots": lambda: section_update(buffer_device="cpu", steps=2),
            "update_profile": lambda: section_update(profile=True),
            "update_fp8": section_update_fp8, "update_delta": lambda: bench_gpu_delta.section_update_delta(),
            "update_delta_fp8": lambda: bench_gpu_delta.section_update_delta(fp8_config(), "tp=2,ep=2", steps=2),
            "delta_profile": lambda: profile_gpu_delta.section_delta_profile(),
            "full_profile": lambda: profile_full_update.section_full_profile(),
            "full_profile_quick": lambda: profile_full_update.section_full_profile(
                steps=3, settings=profile_full_update.SETTINGS[:2]),
            "full_profile_slots": lambda: profile_full_update.section_full_profile(  # 1 GiB of slots, or 4 x 512 MiB
                steps=3, settings=((4, 256 << 20), (8, 128 << 20), (2, 512 << 20), (4, 512 << 20)), profiled=False),
            "detection": lambda: bench_gpu_delta.detection_rows(),
            "update_wire": lambda: bench_gpu_wire.section_update_wire(),
            "update_wire_mooncake": lambda: bench_gpu_wire.section_update_wire(pairs=bench_gpu_wire.PAIRS[:2]),
            "update_wire_nixl": lambda: bench_gpu_wire.section_update_wire(pairs=bench_gpu_wire.PAIRS[2:]),
            # Qwen3-0.6B (1.19 GB per update): the NIXL/UCX TCP pairs fit one device call
            "update_wire_small": lambda: bench_gpu_wire.section_update_wire(
                "qwen3-0.6b", "tp=1", pairs=bench_gpu_wire.PAIRS[2:] + bench_gpu_wire.PAIRS[:2]),
            "tests": section_tests, "profile": section_profile, "connect": section_connect}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default=",".join(SECTIONS))
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_results.json"))
    p.add_argument("--one", help=argparse.SUPPRESS)  # run one section in this process, print JSON
    a = p.parse_args()
    if a.one:
        rows = SECTIONS[a.one]()
        print("P2PW_ROWS " + json.dumps(rows), flush=True)
        return 0
    results = {}
    for name in a.sections.split(","):
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, timeout=900)
        rows = None
        for line in proc.stdout.splitlines():
            if line.startswith("P2PW_ROWS "):
                rows = json.loads(line[len("P2PW_ROWS "):])
        results[name] = rows if rows is not None else {"error": (proc.stderr or proc.stdout)[-3000:]}
        print(f"== {name} ({time.perf_counter() - t0:.0f} s)")
        if isinstance(results[name], list):
            for r in results[name]:
                print("  " + ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
        else:
            print(results[name]["error"])
        sys.stdout.flush()
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
