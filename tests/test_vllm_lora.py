"""vLLM's LoRA tensors as the replica describes them, held to vLLM's own tensors after vLLM's own adapter load.

The "engine" here is vLLM 0.33's own code as an engine rank's worker runs it
(``LoRAModelRunnerMixin.load_lora_model`` then ``add_lora``): the rank's model built for real on
CPU under a LoRA-enabled ``VllmConfig``, ``LRUCacheWorkerLoRAManager.create_lora_manager`` over it,
adapters loaded from PEFT files by ``add_adapter`` (which activates them into vLLM's first free
slot, evicting the least recently used one when all are taken); replica/vllm_lora_reference.py,
the reference ``check-layout --engine-kind vllm --lora`` uses too. The replica
(replica/vllm_lora.py) builds its own rank over CPU stand-ins of the base parameters, from its own
config folder, and loads from tensors; every byte of every slot region it reports must equal the
engine's bytes at that region, on every rank.
"""
from __future__ import annotations

import json
import os

import pytest

try:
    import vllm  # noqa: F401  (the platform is not resolved by this import)
except ImportError as e:  # the only reason to skip: docs/vllm.md says how to install it
    pytest.skip(f"vllm is not importable ({e}); install vllm 0.33.0 as docs/vllm.md says",
                allow_module_level=True)
torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from p2pweights.errors import LayoutMismatch  # noqa: E402
from p2pweights.replica.lora_reference import random_peft_adapter, write_peft_adapter  # noqa: E402
from p2pweights.replica.vllm_layout import VllmLayout  # noqa: E402
from p2pweights.replica.vllm_lora import VllmLoRAReplica, VllmLoRASetting, vllm_lora_replica  # noqa: E402
from p2pweights.replica.vllm_lora_reference import engine_adds, engine_tensor, engine_worker, vllm_lora_on_cpu  # noqa: E402
from replica_configs import write_config  # noqa: E402

SETTING = VllmLoRASetting(max_lora_rank=8, max_loras=2)


@pytest.fixture(scope="module", autouse=True)
def vllm_lora_runs_on_this_cpu_host():
    """The library's two shims for check-layout --lora on a host without an accelerator, for this
    module only: ``PunicaWrapperCPU`` for vLLM's GPU punica wrapper (kernel metadata, never an
    adapter byte) and ``pin_memory`` as the identity (replica/vllm_lora_reference.py says why)."""
    with vllm_lora_on_cpu():
        yield


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Separate config folders for the engine and the replica (nothing shared between them)."""
    root = tmp_path_factory.mktemp("vllm_lora")
    return {"engine": write_config("qwen3", str(root / "engine")),
            "replica": write_config("qwen3", str(root / "replica")),
            "adapters": str(root / "adapters")}


def engine_slot_bytes(worker, layout) -> dict:
    """Every engine byte at the regions the replica reports, per slot."""
    out = {}
    for slot in range(layout.slots):
        for region in layout.slot_regions(slot):
            flat = engine_tensor(worker, layout.buffer(region.buffer)).reshape(-1).view(torch.uint8)
            out[(slot, region.buffer)] = flat[region.offset:region.end].clone()
    return out


def assert_same(replica_bytes: dict, engine: dict, slot: int, what: str) -> None:
    for name, got in replica_bytes.items():
        assert torch.equal(got, engine[(slot, name)]), f"{what}: slot {slot} buffer {name} differs"


@pytest.mark.parametrize("tp", [1, 2])
def test_every_slot_byte_equals_vllms_own_adapter_load_on_every_rank(dirs, tp):
    with open(os.path.join(dirs["engine"], "config.json")) as f:
        cfg = json.load(f)
    # r=4 bf16; r=2 fp32 with alpha/r = 1.5 (cast, then scaling folded into B in bf16); rsLoRA on
    # q, v and down only (k and the other slices stay zero)
    a = random_peft_adapter(cfg, r=4, alpha=8, seed=1)
    b = random_peft_adapter(cfg, r=2, alpha=3, seed=2, dtype=torch.float32)
    c = random_peft_adapter(cfg, r=4, alpha=6, seed=3, targets=("q_proj", "v_proj", "down_proj"), use_rslora=True)
    paths = {n: write_peft_adapter(os.path.join(dirs["adapters"], n), *ad) for n, ad in (("a", a), ("b", b), ("c", c))}
    layout = VllmLayout(tp=tp)
    for rank in range(tp):
        replica = vllm_lora_replica(dirs["replica"], SETTING, layout, rank)
        model, worker = engine_worker(dirs["engine"], SETTING, layout, rank)
        manager = worker._adapter_manager
        engine_linears = [t for m in manager.modules.values() if hasattr(m, "n_slices")
                          for t in (*m.lora_a_stacked, *m.lora_b_stacked)]
        ptrs = [t.data_ptr() for t in engine_linears]
        # the replica describes every LoRA tensor of the engine's decoder layers, with vLLM's shapes
        assert len(replica.layout.buffers) == len(engine_linears) == 2 * cfg["num_hidden_layers"] * (3 + 1 + 2 + 1)
        for buf in replica.layout.buffers:
            t = engine_tensor(worker, buf)
            assert (buf.shape, buf.dtype, buf.nbytes) == (tuple(t.shape), "bfloat16", t.numel() * t.element_size())

        slot_a = engine_adds(model, worker, "a", 1, paths["a"])
        slot_b = engine_adds(model, worker, "b", 2, paths["b"])
        assert (slot_a, slot_b) == (0, 1)
        engine = engine_slot_bytes(worker, replica.layout)
        before = {n: t.clone() for n, t in a[1].items()}
        got_a = replica.adapter_slot_bytes(*a, slot_a, name="a")
        assert all(torch.equal(before[n], t) for n, t in a[1].items())  # the caller's tensors are left as they were
        assert_same(got_a, engine, slot_a, f"tp={tp} rank {rank} adapter a")
        assert all(bool(v.any()) for v in got_a.values())  # every slice of every module adapted
        assert_same(replica.adapter_slot_bytes(*b, slot_b, name="b"), engine, slot_b, f"tp={tp} rank {rank} adapter b")

        # a third adapter evicts the least recently used (a) from slot 0; vLLM zeroes the slot first,
        # and so does the replica reused in the slot where it just put a
        slot_c = engine_adds(model, worker, "c", 3, paths["c"])
        assert slot_c == slot_a and manager.lora_index_to_id == [3, 2]
        engine = engine_slot_bytes(worker, replica.layout)
        got_c = replica.adapter_slot_bytes(*c, slot_c, name="c")
        assert_same(got_c, engine, slot_c, f"tp={tp} rank {rank} adapter c")
        assert not got_c["lora.A.qkv_proj.s1.L0"].any() and not got_c["lora.B.gate_up_proj.s0.L1"].any()
        assert got_c["lora.B.qkv_proj.s2.L1"].any()
        # the embedding and lm_head wrappers the layout leaves out hold zeros in an adapter's slot
        outside = [m for m in manager.modules.values() if not hasattr(m, "n_slices")]
        assert outside and all(not t[slot_c].any() for m in outside for t in (m.lora_a_stacked, m.lora_b_stacked))
        # vLLM's tensors never move (one-sided writes need stable addresses)
        assert [t.data_ptr() for t in engine_linears] == ptrs

        # slot regions: disjoint, inside their buffers, and all slots tile each buffer exactly
        for buf in replica.layout.buffers:
            regions = sorted((buf.slot_region(s) for s in range(replica.layout.slots)), key=lambda r: r.offset)
            assert regions[0].offset == 0 and regions[-1].end == buf.nbytes
            assert all(x.end == y.offset for x, y in zip(regions, regions[1:]))
        assert replica.layout.slot_nbytes * replica.layout.slots == replica.layout.nbytes

    if tp == 2:  # q heads split, KV heads one per rank, MLP input and output halves
        shapes = {b.name: b.shape for b in replica.layout.buffers}
        assert shapes["lora.A.qkv_proj.s0.L0"] == (2, 1, 8, 64)
        assert [shapes[f"lora.B.qkv_proj.s{i}.L0"] for i in range(3)] == [(2, 1, 32, 8), (2, 1, 16, 8), (2, 1, 16, 8)]
        assert (shapes["lora.A.o_proj.s0.L0"], shapes["lora.B.o_proj.s0.L0"]) == ((2, 1, 8, 32), (2, 1, 64, 8))
        assert shapes["lora.B.gate_up_proj.s1.L0"] == (2, 1, 48, 8)
        assert (shapes["lora.A.down_proj.s0.L0"], shapes["lora.B.down_proj.s0.L0"]) == ((2, 1, 8, 48), (2, 1, 64, 8))
        assert replica.layout.slice_modules["qkv_proj"] == ("q_proj", "k_proj", "v_proj")


def test_an_adapter_above_max_lora_rank_is_refused_in_one_line_naming_adapter_module_and_fix(dirs):
    with open(os.path.join(dirs["replica"], "config.json")) as f:
        cfg = json.load(f)
    replica = vllm_lora_replica(dirs["replica"], SETTING, "tp=1", 0)
    with pytest.raises(LayoutMismatch) as e:
        replica.adapter_slot_bytes(*random_peft_adapter(cfg, r=16, alpha=16, seed=4), 0, name="wide")
    message = str(e.value)
    assert "\n" not in message
    assert "'wide'" in message and "r=16" in message and "q_proj" in message
    assert "--max-lora-rank 16" in message and "r <= 8" in message


def test_an_adapter_of_a_module_outside_the_engines_targets_is_refused(dirs):
    with open(os.path.join(dirs["replica"], "config.json")) as f:
        cfg = json.load(f)
    setting = VllmLoRASetting(max_lora_rank=8, max_loras=2, target_modules=("q_proj", "k_proj", "v_proj"))
    replica = VllmLoRAReplica.build(dirs["replica"], setting, "tp=1", 0)
    assert sorted(replica.layout.slice_modules) == ["qkv_proj"]
    with pytest.raises(LayoutMismatch) as e:
        replica.adapter_slot_bytes(*random_peft_adapter(cfg, r=4, alpha=8, seed=5), 0, name="all7")
    message = str(e.value)
    assert "\n" not in message and "'all7'" in message and "o_proj" in message and "--lora-target-modules" in message
