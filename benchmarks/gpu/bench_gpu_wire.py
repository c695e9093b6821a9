"""Where the wire bounds the write (issue "Updates at wire speed at scale", item 3): full vs 1% delta
updates over Ethernet-class transports — Mooncake over TCP, NIXL over UCX's TCP transport — into a
VRAM receiver, with host and GPU slots; every step checked byte for byte. A section of bench_gpu.py
(``update_wire``); each (transport, slots) pair runs in its own engine and sender.

Per pair: version 0 (the first update: full), versions 1..``steps`` (``fraction`` of the elements
changed: deltas), the last version again with delta=False (a steady full update in the same run),
then a fresh checkpoint (every element new) with delta="auto" and another with delta=False. Targets:
steady 1% delta <= 0.10x the steady full update of the same run; ``auto`` on a fresh checkpoint <=
1.05x delta=False.
"""
from __future__ import annotations

import os

#: UCX over TCP: tcp for the bytes, cuda_copy to stage VRAM through host memory (what a NIC without
#: GPUDirect does); loopback only, as on these machines
UCX_TCP = {"UCX_TLS": "tcp,cuda_copy", "UCX_NET_DEVICES": "lo"}
PAIRS = (("mooncake", "cuda"), ("mooncake", "cpu"), ("nixl", "cuda"), ("nixl", "cpu"))


def section_update_wire(model: str = "qwen3-4b", spec: str = "tp=2", fraction: float = 0.01, steps: int = 2,
                        pairs=PAIRS, device: str = "cuda") -> list[dict]:
    """``device="cpu"``: a host receiver and trainer tensors in host memory, UCX over plain tcp (no
    cuda_copy): the same family on a machine without a GPU (tests/test_bench_gpu_wire.py)."""
    from bench_gpu_delta import delta_steps  # beside this file

    from p2pweights.control import SglangEngine
    from p2pweights.models import resolve_model
    from p2pweights.models.checkpoint import trainer_tensors
    from p2pweights.receiver import start_engine
    from p2pweights.sender import WeightSender

    cfg = resolve_model(model)
    specs = trainer_tensors(cfg)
    rows = []
    for transport, slots in pairs:
        env = {"P2PW_RECEIVER_DEVICE": "cuda:0", "P2PW_DELTA_AREA": str(512 << 20)} if device != "cpu" else {}
        if transport == "nixl":
            ucx = UCX_TCP if device != "cpu" else {**UCX_TCP, "UCX_TLS": "tcp"}
            env.update(ucx)
            os.environ.update(ucx)  # the sender's agent, created below, reads them too
        else:
            env["P2PW_MOONCAKE_PROTOCOL"] = os.environ["P2PW_MOONCAKE_PROTOCOL"] = "tcp"
        engine = start_engine(cfg, spec, transport=transport, name=f"wire-{transport}", env=env, startup_timeout=600)
        try:
            sender = WeightSender(cfg, transport=transport, buffer_device=slots)
            sender.connect([SglangEngine(engine.url, name=f"wire-{transport}")])
            if getattr(sender, "recorder", None) is not None:
                sender.recorder.wait()
            for label, delta, r, wall, equal in delta_steps(engine, sender, specs, fraction, steps, device=device):
                rows.append({"transport": f"{transport} tcp", "slots": slots, "update": label, "delta": str(delta),
                             "bytes": r.bytes, "bytes_written": r.bytes_written, "seconds": r.seconds, "wall_s": wall,
                             "data_s": r.data_seconds, "gbps_written": r.bytes_written / max(r.data_seconds, 1e-9) / 1e9,
                             "reasons": sorted(set(r.delta_reason.values())), "equal": equal})
            sender.close()
        finally:
            engine.close()
    return rows + ratios(rows)


def ratios(rows: list[dict]) -> list[dict]:
    """Per (transport, slots): the last delta step over the steady full one, fresh auto over fresh full."""
    out = []
    for key in sorted({(r["transport"], r["slots"]) for r in rows}):
        mine = [r for r in rows if (r["transport"], r["slots"]) == key]
        by = {r["update"]: r for r in mine}
        deltas = [r for r in mine if r["update"].startswith("v") and r["update"] not in ("v0",)
                  and not r["update"].endswith("again")]
        full = next((r for r in mine if r["update"].endswith("again")), None)
        if not deltas or full is None or "fresh 1" not in by or "fresh 2" not in by:
            continue
        out.append({"transport": key[0], "slots": key[1], "delta_over_full": deltas[-1]["seconds"] / full["seconds"],
                    "fresh_auto_over_full": by["fresh 1"]["seconds"] / by["fresh 2"]["seconds"],
                    "all_equal": all(r["equal"] for r in mine)})
    return out
