"""``p2pweights check-layout --lora R[,targets]``: the replica's adapter slot bytes against the engine's own adapter load.

For the model and engine layout, a random PEFT adapter of rank R over the targets
(:func:`.lora_reference.random_peft_adapter`) is written as files to a temporary folder. On every
engine rank (or one):

- the replica (:mod:`.lora_pool` for sglang, :mod:`.vllm_lora` for vLLM) is built and refuses an
  adapter the engine could not hold (rank over ``--max-lora-rank``, a module outside the engine's
  target modules): one line, exit code 2;
- the engine's own code loads the files into every adapter slot (sglang: slots 1..S-1, by
  ``load_lora_adapter`` and ``fetch_new_loras`` into the rank's real CPU model,
  :mod:`.lora_reference`; vLLM: slots 0..S-1, by the worker's ``add_adapter``,
  :mod:`.vllm_lora_reference`);
- the engine's LoRA tensors must be the replica's buffers (names, shapes, dtypes, bytes), and
  ``adapter_slot_bytes`` at each slot must equal, byte for byte, the engine's bytes at that slot's
  regions.

Exit code 0 only when every rank is equal; 1 on a difference or an engine-side load that fails.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from ..errors import P2PWeightsError
from ..models import load_config, resolve_model
from ..models.engine_layout import EngineLayout
from . import lora_reference, vllm_lora_reference
from .lora_layout import DENSE_TARGETS, LoRASetting
from .lora_pool import lora_pool_replica
from .vllm_layout import VllmLayout, check_refusal
from .vllm_lora import VllmLoRASetting, vllm_lora_replica

#: the ranks vLLM 0.33 accepts for --max-lora-rank (its ``MaxLoRARanks``), 1 left out: the default
#: --max-lora-rank is the smallest of these that holds R, so a small R leaves padding to check
MAX_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_SLOTS = 2  # sglang: slot 0 is the base model's, slot 1 the adapter's; vLLM: slots 0 and 1
_SHORT = {m.removesuffix("_proj"): m for m in DENSE_TARGETS}


def parse_lora_spec(spec: str) -> tuple[int, tuple[str, ...]]:
    """``"4"`` -> (4, the seven dense targets); ``"4,q,v,down_proj"`` -> (4, ("q_proj", "v_proj",
    "down_proj")). ValueError naming what is wrong."""
    head, *names = [p.strip() for p in spec.split(",")]
    try:
        r = int(head)
    except ValueError:
        raise ValueError(f"--lora {spec}: the first item must be the adapter's rank R (an integer)") from None
    if r < 1:
        raise ValueError(f"--lora {spec}: the rank must be at least 1")
    targets = []
    for name in names or DENSE_TARGETS:
        target = _SHORT.get(name, name)
        if target not in DENSE_TARGETS:
            raise ValueError(f"--lora {spec}: unknown target {name!r}; targets are "
                             f"{', '.join(_SHORT)} (or {', '.join(DENSE_TARGETS)})")
        if target not in targets:
            targets.append(target)
    return r, tuple(targets)


def default_max_lora_rank(r: int) -> int:
    return next((m for m in MAX_LORA_RANKS if m >= r), r)


@dataclass
class LoRARankCheck:
    """One engine rank: the replica's buffers and slot bytes held to the engine's."""

    rank: int
    buffers: int
    slot_nbytes: int
    slots: list[int]
    first_difference: str | None = None  # "slot 1 lora.A.qkv_proj.L0", "buffers: ...", an engine-side failure
    differences: int = 0
    seconds: float = 0.0

    @property
    def equal(self) -> bool:
        return self.first_difference is None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "equal": self.equal}


def _compare(result: LoRARankCheck, layout: Any, engine_described: dict, produce: Callable[[int], dict],
             engine_tensor: Callable[[Any], Any]) -> None:
    """Fill ``result``: buffers described alike, then every slot's bytes, buffer by buffer."""
    import torch

    replica_described = {b.name: (b.shape, b.dtype, b.nbytes) for b in layout.buffers}
    for name in sorted(set(engine_described) | set(replica_described)):
        if engine_described.get(name) != replica_described.get(name):
            result.differences += 1
            result.first_difference = result.first_difference or (
                f"buffer {name}: engine {engine_described.get(name, 'has none')}, "
                f"replica {replica_described.get(name, 'has none')}")
    if result.differences:
        return
    for slot in result.slots:
        produced = produce(slot)
        for buffer, region in zip(layout.buffers, layout.slot_regions(slot)):
            engine_bytes = engine_tensor(buffer).contiguous().view(-1).view(torch.uint8)
            if not bool((produced[buffer.name] == engine_bytes[region.offset:region.end]).all()):
                result.differences += 1
                result.first_difference = result.first_difference or f"slot {slot} {buffer.name}"


def _sglang_rank(path: str, setting: LoRASetting, engine: EngineLayout, rank: int, adapter: tuple,
                 adapter_dir: str, name: str) -> LoRARankCheck:
    adapter_config, tensors = adapter
    with lora_reference.sglang_lora_on_cpu():
        replica = lora_pool_replica(path, setting, engine, rank)
        replica.check_adapter(adapter_config, tensors.keys(), name)  # a refusal: one line, exit 2
        layout = replica.layout
        result = LoRARankCheck(rank, len(layout.buffers), layout.slot_nbytes, [])
        try:
            manager, context = lora_reference.engine_lora_manager(path, setting, engine, rank)
            result.slots = [lora_reference.engine_loads(manager, context, f"{name}-{i}", adapter_dir)
                            for i in range(1, layout.slots)]
        except Exception as e:  # the engine's own build or load fails: not equal, with sglang's words
            result.first_difference = f"sglang's own adapter load failed: {type(e).__name__}: {e}"
            return result
        _compare(result, layout, lora_reference.engine_buffers(manager),
                 lambda slot: replica.adapter_slot_bytes(adapter_config, tensors, slot, name=name),
                 lambda buffer: lora_reference.engine_buffer(manager, buffer))
    return result


def _vllm_rank(path: str, setting: VllmLoRASetting, layout: VllmLayout, rank: int, adapter: tuple,
               adapter_dir: str, name: str) -> LoRARankCheck:
    adapter_config, tensors = adapter
    with vllm_lora_reference.vllm_lora_on_cpu():
        replica = vllm_lora_replica(path, setting, layout, rank)
        replica.check_adapter(adapter_config, tensors, name)  # a refusal: one line, exit 2
        described = replica.layout
        result = LoRARankCheck(rank, len(described.buffers), described.slot_nbytes, [])
        try:
            model, worker = vllm_lora_reference.engine_worker(path, setting, layout, rank)
            result.slots = [vllm_lora_reference.engine_adds(model, worker, f"{name}-{i}", i + 1, adapter_dir)
                            for i in range(described.slots)]
        except Exception as e:  # the engine's own build or load fails: not equal, with vLLM's words
            result.first_difference = f"vLLM's own adapter load failed: {type(e).__name__}: {e}"
            return result
        _compare(result, described, vllm_lora_reference.engine_buffers(worker),
                 lambda slot: replica.adapter_slot_bytes(adapter_config, tensors, slot, name=name),
                 lambda buffer: vllm_lora_reference.engine_tensor(worker, buffer))
    return result


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def run_check_lora(model: str, spec: str, lora: str, *, engine_kind: str = "sglang", rank: int | None = None,
                   seed: int = 0, max_lora_rank: int | None = None, slots: int | None = None,
                   target_modules: list[str] | None = None, as_json: bool = False) -> int:
    """``check-layout --lora``: print the table (or one JSON object); exit code 0 only when every
    rank is equal, 1 on a difference, 2 on a refusal (one line on stderr)."""
    def refuse(message: str) -> int:
        print(f"p2pweights check-layout: error: {message}", file=sys.stderr)
        return 2

    try:
        r, targets = parse_lora_spec(lora)
    except ValueError as e:
        return refuse(str(e))
    max_rank = max_lora_rank or default_max_lora_rank(r)
    slots = DEFAULT_SLOTS if slots is None else slots
    name = f"random-r{r}"
    try:
        path = resolve_model(model)
        adapter = lora_reference.random_peft_adapter(path, r=r, targets=targets, seed=seed, alpha=3 * r)
        if engine_kind == "vllm":
            layout: Any = VllmLayout.parse(spec, command="check-layout")
            check_refusal(load_config(path), layout)
            setting: Any = VllmLoRASetting(max_lora_rank=max_rank, max_loras=slots,
                                           target_modules=tuple(target_modules) if target_modules else None)
            check_rank = _vllm_rank
        else:
            if slots < 2:
                return refuse(f"--max-loras-per-batch {slots}: sglang's slot 0 is the base model's, so an "
                              f"adapter needs at least 2")
            layout = EngineLayout.parse(spec, command="check-layout")
            setting = LoRASetting(max_lora_rank=max_rank, target_modules=tuple(target_modules or targets),
                                  max_loras_per_batch=slots)
            check_rank = _sglang_rank
    except (P2PWeightsError, ValueError) as e:
        return refuse(_one_line(e))
    if rank is not None and not 0 <= rank < layout.world_size:
        return refuse(f"--rank {rank} is not a rank of {layout.describe()} ({layout.world_size} ranks)")

    results: list[LoRARankCheck] = []
    with tempfile.TemporaryDirectory(prefix="p2pw_lora_check_") as adapter_dir:
        lora_reference.write_peft_adapter(adapter_dir, *adapter)
        for rk in range(layout.world_size) if rank is None else [rank]:
            t0 = time.perf_counter()
            try:
                result = check_rank(path, setting, layout, rk, adapter, adapter_dir, name)
            except P2PWeightsError as e:  # the replica refuses the adapter or the layout
                return refuse(_one_line(e))
            result.seconds = time.perf_counter() - t0
            results.append(result)
            if not as_json:
                if len(results) == 1:  # after the first rank's replica took the adapter: a refusal is one line
                    kind = "" if engine_kind == "vllm" else "sglang "  # vLLM's layouts say "vllm:" themselves
                    print(f"{kind}{layout.describe()}: adapter r={r} on {' '.join(targets)} (seed {seed}); "
                          f"engine {setting.flags()}")
                    print(f"{'rank':>4}  {'buffers':>7}  {'slot bytes':>10}  {'slots':<8}  equal")
                verdict = "yes" if result.equal else f"NO ({result.differences}): {_one_line(result.first_difference)}"
                print(f"{rk:>4}  {result.buffers:>7}  {result.slot_nbytes:>10,}  "
                      f"{','.join(map(str, result.slots)):<8}  {verdict} [{result.seconds:.1f} s]")
    equal = all(x.equal for x in results)
    if as_json:
        print(json.dumps({"equal": equal, "engine_kind": engine_kind, "engine": layout.describe(),
                          "lora": {"r": r, "targets": list(targets), "flags": setting.flags(), "seed": seed},
                          "ranks": [x.to_json() for x in results]}))
    else:
        print(f"{layout.describe()}: {'OK, byte-exact' if equal else 'FAILED'} over {len(results)} rank(s) "
              f"(the {engine_kind} engine's own adapter load of the same PEFT files)")
    return 0 if equal else 1
