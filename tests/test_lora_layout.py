"""sglang's LoRA pool as the replica describes it, held to sglang's own pool and sglang's own adapter load.

The "engine" here is sglang's own code as an engine rank runs it (ModelRunner.maybe_init_lora_manager):
the rank's model built for real on CPU, ``LoRAManager`` over it, adapters loaded from PEFT files by
``load_lora_adapter`` and placed in slots by ``fetch_new_loras``. The replica (replica/lora_pool.py)
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
from p2pweights.replica import sglang_env  # noqa: E402
from p2pweights.replica.lora_layout import DENSE_TARGETS, LoRASetting  # noqa: E402
from p2pweights.replica.lora_pool import LoRAPoolReplica, lora_pool_replica  # noqa: E402
from replica_configs import write_config  # noqa: E402

SETTING = LoRASetting(max_lora_rank=8, target_modules=DENSE_TARGETS, max_loras_per_batch=3)
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@pytest.fixture(scope="module", autouse=True)
def pinned_memory_is_plain_memory_on_a_cpu_host():
    """sglang's LoRA layers allocate pinned host tensors (``torch.tensor(..., pin_memory=True)`` and
    ``.pin_memory()`` in sglang/srt/lora/layers.py); with no accelerator torch refuses. Pinning only
    speeds up host-to-device copies, never changes bytes: on this CPU test host it is dropped. Test-only;
    the library leaves torch alone."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.tensor

    def tensor(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "tensor", tensor)
        mp.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
        yield


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    return write_config("qwen3", str(tmp_path_factory.mktemp("qwen3_lora")))


def peft_adapter(cfg: dict, *, r: int, alpha: int, seed: int, dtype=torch.bfloat16, targets=DENSE_TARGETS):
    """A random PEFT LoRA adapter of the tiny model: (adapter_config dict, {peft name: tensor})."""
    g = torch.Generator().manual_seed(seed)
    hidden, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    dims = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for m in targets:
            fan_in, fan_out = dims[m]
            prefix = f"base_model.model.model.layers.{layer}.{_PARENT[m]}.{m}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(r, fan_in, generator=g).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, r, generator=g).to(dtype)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "lora_dropout": 0.0,
              "bias": "none", "task_type": "CAUSAL_LM", "use_rslora": False, "use_dora": False,
              "base_model_name_or_path": "tiny-qwen3"}
    return config, tensors


def write_adapter(directory: str, config: dict, tensors: dict) -> str:
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"))
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return directory


def engine_lora_manager(config_dir: str, setting: LoRASetting, tp: int, rank: int):
    """sglang's own LoRA manager of engine rank ``rank``, as ModelRunner builds it (real CPU model)."""
    sglang_env.prepare()
    from sglang.srt import runtime_context as rc
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.server_args import ServerArgs

    sglang_env.import_model_modules(config_dir)
    server_args = ServerArgs(model_path=config_dir, device="cuda", skip_tokenizer_init=True, tp_size=tp,
                             **setting.server_args())
    context = sglang_env.rank_context(server_args, rank)
    with rc.use_context(context):
        model_config = ModelConfig.from_server_args(server_args)
        load_config = LoadConfig(load_format=server_args.load_format)
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            model = _initialize_model(model_config, load_config, _get_quantization_config(model_config, load_config))
        lora = rc.get_lora()
        manager = LoRAManager(base_model=model, base_hf_config=model_config.hf_config,
                              max_loras_per_batch=lora.max_loras_per_batch, load_config=load_config,
                              dtype=model_config.dtype, server_args=server_args, lora_backend=lora.lora_backend,
                              max_lora_rank=lora.max_lora_rank, target_modules=lora.lora_target_modules,
                              lora_paths=lora.lora_paths)
    return manager, context


def engine_loads(manager, context, name: str, path: str) -> int:
    """The engine's own load of adapter files (/load_lora_adapter), then a batch asking for it
    (fetch_new_loras, what ForwardBatch.init_new does): the slot sglang gave it."""
    from sglang.srt import runtime_context as rc
    from sglang.srt.lora.lora_registry import LoRARef

    ref = LoRARef(lora_id=f"id-{name}", lora_name=name, lora_path=path, pinned=False)
    with rc.use_context(context):
        result = manager.load_lora_adapter(ref)
        assert result.success, result.error_message
        manager.fetch_new_loras({ref.lora_id})
    return manager.memory_pool.uid_to_buffer_id[ref.lora_id]


def engine_buffer(manager, buffer) -> "torch.Tensor":
    pool = manager.memory_pool
    side = pool.A_buffer if buffer.side == "A" else pool.B_buffer
    return side[buffer.module][buffer.layer]


@pytest.mark.parametrize("tp", [1, 2, 4])  # 4: KV heads (2) replicated over ranks
def test_replica_slot_bytes_equal_sglangs_own_adapter_load_on_every_rank(config_dir, tmp_path, tp):
    cfg = json.load(open(os.path.join(config_dir, "config.json")))
    adapters = {  # r < max_lora_rank; one of them fp32, cast into the bf16 pool by sglang's copy
        "a4": peft_adapter(cfg, r=4, alpha=8, seed=1),
        "a2": peft_adapter(cfg, r=2, alpha=6, seed=2, dtype=torch.float32),
    }
    paths = {name: write_adapter(str(tmp_path / name), *adapter) for name, adapter in adapters.items()}
    for rank in range(tp):
        manager, context = engine_lora_manager(config_dir, SETTING, tp, rank)
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
    adapter_config, tensors = peft_adapter(cfg, r=16, alpha=16, seed=3)
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
    adapter_config, tensors = peft_adapter(cfg, r=4, alpha=8, seed=4)
    with pytest.raises(LayoutMismatch) as e:
        replica.adapter_slot_bytes(adapter_config, tensors, 1, name="mlp-too")
    text = str(e.value)
    assert ("\n" not in text and "'mlp-too'" in text and "gate_proj" in text
            and "--lora-target-modules" in text and "restart the engine with gate_proj" in text), text
