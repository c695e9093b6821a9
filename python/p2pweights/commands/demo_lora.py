"""``p2pweights demo --lora R``: a LoRA adapter of rank R updated one-sided, step after step (docs/lora.md).

E receiver engines of T ranks start with sglang's LoRA pool (``--max-lora-rank R``, the dense
targets q/k/v/o/gate/up/down, 3 slots); each loads one adapter, ``demo``, once by the engine's own
API (pinned), which picks its slot. One in-process sender then runs ``--steps`` adapter updates
(``sender.update(step, adapter="demo")``): step 1 a fresh random adapter (written whole: the
engines hold the loaded one), each later step the previous one with a fraction F of its elements
changed (``--changed-fraction``, default 0.01): written as the 4 KiB blocks that changed.

One row per step: the adapter's slot bytes over every engine rank, the bytes written, full or
delta, the seconds (pause to continue), what a merged update (the adapter folded into the base
weights, sent as full weights) would move to the same engines, and ``equal``: every engine rank's
slot, digested by the engine, equals sglang's own load of the same adapter files into a fresh LoRA
manager of that rank (replica/lora_reference.py), unless ``--no-check``.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from ..control import SglangEngine
from ..control.weights_digest import digest
from ..models.engine_layout import EngineLayout
from ..receiver import LocalEngine, start_together
from ..replica.lora_layout import DENSE_TARGETS, LoRASetting, buffer_name
from ..replica.lora_reference import (
    engine_loads,
    engine_lora_manager,
    random_peft_adapter,
    sglang_lora_on_cpu,
    write_peft_adapter,
)
from ..sender import WeightSender
from ..sender.verify import _ask
from ..settings import format_size

ADAPTER = "demo"


@dataclass
class LoRARow:
    step: int
    adapter_version: str
    written: str  # "full" or "delta"
    bytes: int  # the adapter's slot bytes over every engine rank
    bytes_written: int
    merged_bytes: int  # a merged update's bytes to the same engines (every engine rank's weights)
    seconds: float
    equal: bool | None


HEADER = (f"{'step':>4}  {'version':<7} {'written':<7} {'slot bytes':>11}  {'bytes written':>13}  {'seconds':>8}  "
          f"{'merged would move':>17}  equal")


def row_text(r: LoRARow) -> str:
    eq = {True: "yes", False: "NO", None: "-"}[r.equal]
    return (f"{r.step:>4}  {r.adapter_version:<7} {r.written:<7} {format_size(r.bytes):>11}  "
            f"{format_size(r.bytes_written):>13}  {r.seconds:>8.3f}  {format_size(r.merged_bytes):>17}  {eq}")


def changed_adapter(tensors: dict, fraction: float, seed: int) -> dict:
    """The adapter with ``fraction`` of each tensor's elements moved, as an RL step moves them."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        t = t.clone()
        flat = t.view(-1)
        k = int(round(fraction * flat.numel()))
        if not k:
            out[name] = t
            continue
        idx = torch.randperm(flat.numel(), generator=g)[:k]
        flat[idx] += (torch.randn(k, generator=g) * 0.01).to(t.dtype)
        out[name] = t
    return out


def run_lora_demo(model: str, *, rank: int, engines: int = 2, engine: str = "tp=2", transport: str = "mooncake",
                  steps: int = 4, changed_fraction: float | None = None, check: bool = True, verify: bool = False,
                  progress: Callable[[str], None] = print) -> list[LoRARow]:

    setting = LoRASetting(max_lora_rank=int(rank), target_modules=DENSE_TARGETS, max_loras_per_batch=3,
                          lora_backend="torch_native")
    fraction = 0.01 if changed_fraction is None else changed_fraction
    workdir = tempfile.mkdtemp(prefix="p2pw-demo-lora-")
    t0 = time.perf_counter()
    progress(f"starting {engines} engine(s) x {engine} with {setting.flags()} ({transport}) ...")
    running = [LocalEngine(model, engine, name=f"engine{i}", transport=transport, lora=setting) for i in range(engines)]
    rows: list[LoRARow] = []
    try:
        start_together(running)
        clients = [SglangEngine(e.url, name=e.name) for e in running]
        config, tensors = random_peft_adapter(model, r=int(rank), seed=0)
        loaded = write_peft_adapter(os.path.join(workdir, "loaded"), config, tensors)
        slots = {c.name: c.load_lora_adapter(ADAPTER, loaded, pinned=True).get("p2pw_slot") for c in clients}
        progress(f"engines up, adapter {ADAPTER!r} loaded by each engine's own API (slots {slots}) in "
                 f"{time.perf_counter() - t0:.1f} s")
        checker = _Checker(model, engine, setting, workdir) if check else None
        with WeightSender(model, transport=transport) as sender:
            sender.connect(clients)
            merged = sum(t.nbytes for p in sender._ranks for t in _targets(p))
            config, tensors = random_peft_adapter(model, r=int(rank), seed=1)
            for step in range(1, steps + 1):
                if step > 1:
                    tensors = changed_adapter(tensors, fraction, seed=step)
                with sender.update(step, adapter=ADAPTER, adapter_config=config if step == 1 else None,
                                   verify=verify) as update:
                    update.push_many(tensors)
                r = update.report
                equal = checker.equal(clients, r.slots, config, tensors, step) if checker else None
                rows.append(LoRARow(step, r.version, "delta" if all(r.delta.values()) else "full", r.bytes,
                                    r.bytes_written, merged, r.seconds, equal))
                progress(row_text(rows[-1]))
    finally:
        for e in running:
            e.close()
    return rows


def _targets(prepared: Any) -> list:
    """Per engine rank this sender writes: its base weights' bytes (the table without adapter slots)."""
    out = []
    for t in prepared.targets:
        nbytes = sum(p.nbytes for n, p in t.publication.params.items() if not n.startswith("lora."))
        out.append(type("T", (), {"nbytes": nbytes}))
    return out


class _Checker:
    """sglang's own load of each step's adapter files into a fresh LoRA manager per engine rank (kept
    across steps), and the engines' digests of their slots compared with it."""

    def __init__(self, model: str, engine: str, setting: Any, workdir: str):

        self.workdir = workdir
        tp = EngineLayout.parse(engine).world_size
        with sglang_lora_on_cpu():
            self.managers = [engine_lora_manager(model, setting, engine, r) for r in range(tp)]

    def equal(self, clients: list, slots: dict, config: dict, tensors: dict, step: int) -> bool:

        path = write_peft_adapter(os.path.join(self.workdir, f"step{step}"), config, tensors)
        want: dict[int, dict[str, str]] = {}
        with sglang_lora_on_cpu():
            for rank, (manager, context) in enumerate(self.managers):
                slot = engine_loads(manager, context, f"step{step}", path)
                pool, want[rank] = manager.memory_pool, {}
                for module in pool.A_buffer:
                    for layer in range(len(pool.A_buffer[module])):
                        for side, buffers in (("A", pool.A_buffer), ("B", pool.B_buffer)):
                            want[rank][buffer_name(side, module, layer)] = digest(buffers[module][layer][slot])
                manager.unload_lora_adapter(next(ref for ref in manager.lora_refs.values()
                                                 if ref.lora_name == f"step{step}"))
        for c in clients:
            slot = slots[c.name]
            names = {str(r): [f"{b}@{slot}" for b in want[r]] for r in want}
            held = _ask(c, names).get("ranks") or {}
            for r, digests in want.items():
                got = held.get(str(r), {})
                if any(got.get(f"{b}@{slot}") != d for b, d in digests.items()):
                    return False
        return True
