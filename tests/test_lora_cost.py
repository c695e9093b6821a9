"""planner/lora_cost.py: the adapter's slot bytes per engine rank, held to the pool sglang itself builds
(replica/lora_pool.py runs sglang's LoRAManager), and the merged-vs-adapter comparison."""
from __future__ import annotations

import json
import os

import pytest

from p2pweights.models import resolve_model
from p2pweights.planner.lora_cost import ATTENTION, MLP, lora_cost, slot_bytes_per_rank
from p2pweights.replica.lora_layout import LoRASetting
from p2pweights.replica.lora_pool import LoRAPoolReplica
from p2pweights.replica.lora_reference import sglang_lora_on_cpu
from replica_configs import write_config


@pytest.mark.parametrize("model,tp,r,targets", [
    ("tiny", 1, 8, ATTENTION + MLP), ("tiny", 2, 8, ATTENTION + MLP), ("tiny", 4, 16, ATTENTION + MLP),
    ("tiny", 2, 8, ("q_proj", "v_proj")), ("qwen3-0.6b", 2, 16, ATTENTION + MLP)])
def test_slot_bytes_equal_sglangs_own_pool(tmp_path, model, tp, r, targets):
    path = write_config("qwen3", str(tmp_path)) if model == "tiny" else resolve_model(model)
    cfg = json.load(open(os.path.join(path, "config.json")))
    setting = LoRASetting(max_lora_rank=r, target_modules=targets, max_loras_per_batch=2)
    for rank in range(tp):
        with sglang_lora_on_cpu():
            pool = LoRAPoolReplica.build(path, setting, f"tp={tp}", rank)
        assert slot_bytes_per_rank(cfg, tp, r, targets) == pool.layout.slot_nbytes, (rank,)


def test_an_adapter_moves_a_small_fraction_of_a_merged_update():
    cfg = json.load(open(os.path.join(resolve_model("qwen3-235b-a22b"), "config.json")))
    cost = lora_cost("qwen3-235b-a22b", cfg, 8, 16, merged_bytes=470 * 10**9)
    assert cost.targets == ATTENTION  # an MoE model: attention only
    assert 0 < cost.ratio < 0.01
    with pytest.raises(ValueError, match="MoE"):
        slot_bytes_per_rank(cfg, 8, 16, ATTENTION + MLP)
