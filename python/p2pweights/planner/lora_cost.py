"""The bytes an adapter update moves against a merged update's, per engine (docs/lora.md, "Merged or adapter").

A trainer that merges its LoRA adapter into the base weights and pushes them moves every engine
rank's weights (every adapted matrix changed); an adapter update moves the adapter's slot of
sglang's LoRA pool on every engine rank (tests/test_lora_cost.py holds :func:`slot_bytes_per_rank`
to the pool sglang itself builds). Pure arithmetic from ``config.json``: no torch, no sglang.

sglang's pool per rank, with ``R = --max-lora-rank`` (the slot is padded to it), per decoder layer:
``qkv_proj`` A ``[3R, hidden]``, B ``[q/tp + 2 * kv_local, R]``; ``o_proj`` A ``[R, q/tp]``, B
``[hidden, R]``; ``gate_up_proj`` A ``[2R, hidden]``, B ``[2 * inter/tp, R]``; ``down_proj`` A
``[R, inter/tp]``, B ``[hidden, R]`` (``q`` = heads x head_dim, ``kv_local`` = the rank's KV heads,
at least one, x head_dim). MoE experts take no dense-MLP adapter here (refused by the replica).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoRACost:
    model: str
    tp: int
    max_lora_rank: int
    targets: tuple[str, ...]
    adapter_bytes: int   # one adapter's slot over every rank of one engine
    merged_bytes: int    # the engine's weights (a merged update writes them all)

    @property
    def ratio(self) -> float:
        return self.adapter_bytes / max(self.merged_bytes, 1)


def _is_moe(cfg: Mapping[str, Any]) -> bool:
    return bool(cfg.get("num_experts") or cfg.get("n_routed_experts"))


def slot_bytes_per_rank(cfg: Mapping[str, Any], tp: int, max_lora_rank: int, targets: tuple[str, ...]) -> int:
    """One adapter slot's bytes on one engine rank of sglang's pool (module docstring)."""
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads, kv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg.get("intermediate_size") or 0)
    r, size = int(max_lora_rank), _DTYPE_BYTES.get(str(cfg.get("torch_dtype") or "bfloat16"), 2)
    q_local, kv_local = heads * head_dim // tp, max(1, kv // tp) * head_dim
    per_layer = 0
    if {"q_proj", "k_proj", "v_proj"} & set(targets):
        per_layer += 3 * r * hidden + (q_local + 2 * kv_local) * r
    if "o_proj" in targets:
        per_layer += r * q_local + hidden * r
    if set(MLP) & set(targets):
        if _is_moe(cfg):
            raise ValueError("LoRA on MoE experts is not built: pick attention targets for an MoE model")
        if {"gate_proj", "up_proj"} & set(targets):
            per_layer += 2 * r * hidden + 2 * (inter // tp) * r
        if "down_proj" in targets:
            per_layer += r * (inter // tp) + hidden * r
    return per_layer * layers * size


def lora_cost(name: str, cfg: Mapping[str, Any], tp: int, max_lora_rank: int, merged_bytes: int,
              targets: tuple[str, ...] | None = None) -> LoRACost:
    """An adapter of rank ``max_lora_rank`` (dense targets; attention only for an MoE model) on an
    engine of ``tp`` ranks against ``merged_bytes`` (the engine's weights)."""
    targets = targets or (ATTENTION if _is_moe(cfg) else ATTENTION + MLP)
    return LoRACost(name, tp, max_lora_rank, tuple(targets), tp * slot_bytes_per_rank(cfg, tp, max_lora_rank, targets),
                    int(merged_bytes))
