"""sglang's LoRA pool as the replica describes it, held to sglang's own pool and sglang's own adapter load.

The "engine" here is sglang's own code as an engine rank runs it (ModelRunner.maybe_init_lora_manager):
the rank's model built for real on CPU, ``LoRAManager`` over it, adapters loaded from PEFT files by
``load_lora_adapter`` and placed in slots by ``fetch_new_loras`` (replica/lora_reference.py, the
reference ``check-layout --lora`` uses too). The replica (replica/lora_pool.py)
builds its pool over CPU stand-ins of the base parameters and loads from tensors; every byte of
every slot region it reports must equal the engine pool's bytes at that region, on every rank.
"""
from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")
pytest.importorskip("safetensors")

from p2pweights.errors import LayoutMismatch  # noqa: E402
from p2pweights.models.engine_layout import EngineLayout  # noqa: E402
from p2pweights.replica.lora_layout import DENSE_TARGETS, LoRASetting  # noqa: E402
from p2pweights.replica.lora_pool import LoRAPoolReplica, lora_pool_replica  # noqa: E402
from p2pweights.replica.lora_reference import (  # noqa: E402
    engine_buffer,
    engine_loads,
    engine_lora_manager,
    random_peft_adapter,
    sglang_lora_on_cpu,
    write_peft_adapter,
)
from replica_configs import write_config  # noqa: E402

SETTING = LoRASetting(max_lora_rank=8, target_modules=DENSE_TARGETS, max_loras_per_batch=3)


@pytest.fixture(scope="module", autouse=True)
def pinned_memory_is_plain_memory_on_a_cpu_host():
    """sglang's LoRA layers ask for pinned host memory, which torch refuses without an accelerator:
    the library's shim for check-layout --lora drops it (never changes a byte), for this module only."""
    with sglang_lora_on_cpu():
        yield


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    return write_config("qwen3", str(tmp_path_factory.mktemp("qwen3_lora")))


@pytest.mark.parametrize("tp", [1, 2, 4])  # 4: KV heads (2) replicated over ranks
def test_replica_slot_bytes_equal_sglangs_own_adapter_load_on_every_rank(config_dir, tmp_path, tp):
    cfg = json.load(open(os.path.join(config_dir, "config.json")))
    adapters = {  # r < max_lora_rank; one of them fp32, cast into the bf16 pool by sglang's copy
        "a4": random_peft_adapter(cfg, r=4, alpha=8, seed=1),
        "a2": random_peft_adapter(cfg, r=2, alpha=6, seed=2, dtype=torch.float32),
    }
    paths = {name: write_peft_adapter(str(tmp_path / name), *adapter) for name, adapter in adapters.items()}
    for rank in range(tp):
        manager, context = engine_lora_manager(config_dir, SETTING, f"tp={tp}", rank)
        slots = {name: engine_loads(manager, context, name, paths[name]) for name in adapters}
        assert sorted(slots.values()) == [1, 2]  # slot 0 is the base model's

        replica = lora_pool_replica(config_dir, SETTING, f"tp={tp}", rank)
        layout = replica.layout
        pool = manager.memory_pool
        assert {b.module for b in layout.buffers} == set(pool.A_buffer) == {"qkv_proj", "o_proj", "gate_up_proj",
                                                                           "down_proj"}
        assert len(layout.buffers) == 2 * len(pool.A_buffer) * cfg["num_hidden_layers"]
        for buffer in layout.buffers:
            t = engine_buffer(manager, buffer)
            assert (buffer.shape, buffer.dtype, buffer.nbytes) == (tuple(t.shape), "bfloat16",
                                                                   t.numel() * t.element_size())

        for name, (adapter_config, tensors) in adapters.items():
            slot = slots[name]
            produced = replica.adapter_slot_bytes(adapter_config, tensors, slot, name=name)
            assert list(produced) == [b.name for b in layout.buffers]
            for buffer, region in zip(layout.buffers, layout.slot_regions(slot)):
                engine_bytes = engine_buffer(manager, buffer).contiguous().view(-1).view(torch.uint8)
                got = produced[buffer.name]
                assert got.numel() == region.nbytes
                assert torch.equal(got, engine_bytes[region.offset:region.end]), \
                    f"tp={tp} rank {rank} adapter {name} slot {slot}: {buffer.name} differs"
                assert got.any(), f"{buffer.name}: every module is adapted, its slot cannot be all zero"

        # a replica reused for another adapter in the same slot leaves nothing of the previous one:
        # a2 (r=2) into the slot where it put a4 (r=4) gives a2's bytes, tails zero
        a2_elsewhere = replica.adapter_slot_bytes(*adapters["a2"], slots["a4"], name="a2")
        a2_own = replica.adapter_slot_bytes(*adapters["a2"], slots["a2"], name="a2")
        assert all(torch.equal(a2_elsewhere[b], a2_own[b]) for b in a2_own)


def test_two_slots_regions_are_disjoint_and_inside_their_buffers(config_dir):
    layout = lora_pool_replica(config_dir, SETTING, "tp=2", 1).layout
    one, two = layout.slot_regions(1), layout.slot_regions(2)
    for buffer, r1, r2 in zip(layout.buffers, one, two):
        for r in (r1, r2):
            assert r.buffer == buffer.name and 0 <= r.offset and r.end <= buffer.nbytes
        assert r1.end <= r2.offset or r2.end <= r1.offset, f"{buffer.name}: slots 1 and 2 overlap"
    assert layout.slot_nbytes * layout.slots == layout.nbytes
    # sglang's shapes at tp=2 (S=3, R=8; hidden 64, 4x16 q heads, 2x16 kv heads, intermediate 96):
    # A [S, c*R, in_local] (row-parallel o/down: in sliced), B [S, out_local, R] (column-parallel: out sliced)
    shapes = {(b.side, b.module): b.shape for b in layout.buffers if b.layer == 0}
    assert shapes == {("A", "qkv_proj"): (3, 24, 64), ("B", "qkv_proj"): (3, 32 + 16 + 16, 8),
                      ("A", "o_proj"): (3, 8, 32), ("B", "o_proj"): (3, 64, 8),
                      ("A", "gate_up_proj"): (3, 16, 64), ("B", "gate_up_proj"): (3, 96, 8),
                      ("A", "down_proj"): (3, 8, 48), ("B", "down_proj"): (3, 64, 8)}


def test_an_adapter_above_max_lora_rank_is_refused_naming_adapter_module_and_fix(config_dir):
    cfg = json.load(open(os.path.join(config_dir, "config.json")))
    adapter_config, tensors = random_peft_adapter(cfg, r=16, alpha=16, seed=3)
    replica = lora_pool_replica(config_dir, SETTING, "tp=1", 0)
    with pytest.raises(LayoutMismatch) as e:
        replica.adapter_slot_bytes(adapter_config, tensors, 1, name="wide")
    text = str(e.value)
    assert "\n" not in text and "'wide'" in text and "q_proj" in text and "--max-lora-rank 16" in text, text


def test_an_adapter_of_a_module_the_engine_was_started_without_is_refused(config_dir):
    cfg = json.load(open(os.path.join(config_dir, "config.json")))
    attention_only = LoRASetting(max_lora_rank=8, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
                                 max_loras_per_batch=3)
    replica = LoRAPoolReplica.build(config_dir, attention_only, EngineLayout.parse("tp=1"), 0)
    assert {b.module for b in replica.layout.buffers} == {"qkv_proj", "o_proj"}
    adapter_config, tensors = random_peft_adapter(cfg, r=4, alpha=8, seed=4)
    with pytest.raises(LayoutMismatch) as e:
        replica.adapter_slot_bytes(adapter_config, tensors, 1, name="mlp-too")
    text = str(e.value)
    assert ("\n" not in text and "'mlp-too'" in text and "gate_proj" in text
            and "--lora-target-modules" in text and "restart the engine with gate_proj" in text), text
