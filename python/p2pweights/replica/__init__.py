"""The sglang meta replica per shard layout, the loader probe, parameter groups and slots.

Public API (imports of torch and sglang stay lazy until first use)::

    EngineLayout.from_server_info(info) / EngineLayout.parse("tp=2,ep=2")   # models/engine_layout.py
    parse_layout_spec(spec, command=..., honours=...)                       # the one --engine parser
    parse_engine_spec("tp=2,ep=2,dp_attention=2")                           # -> server args dict
    model_replicas().get(config_dir, engine, rank) -> ModelReplica           # one per shard layout
    ModelReplica.groups / group_of(hf_name) / largest_group_nbytes / param_nbytes(name)
    ModelReplica.load_group(group, hf_tensors, slot) -> [SlotRegion]   # load_groups: several at once
    check_byte_exact(config_dir, engine, ranks=None) -> LayoutCheck          # check-layout's engine
    sglang_env.prepare() / build_model(...) / activate(model) / materialize(model)
"""
from __future__ import annotations

from typing import Any

from ..models.engine_layout import LAYOUT_ARGS, REPLICA_KEYS, EngineLayout, LayoutSpecError, parse_engine_spec, parse_layout_spec

_LAZY = {
    "ModelReplica": ".model_replica",
    "ModelReplicas": ".model_replica",
    "ReplicaKey": ".model_replica",
    "model_replicas": ".model_replica",
    "ParameterGroup": ".groups",
    "SlotRegion": ".groups",
    "SLOT_ALIGNMENT": ".groups",
    "LoaderMapping": ".probe",
    "probe_loaders": ".probe",
    "check_byte_exact": ".check",
    "check_rank": ".check",
    "LayoutCheck": ".check",
    "build_model": ".sglang_env",
    "materialize": ".sglang_env",
    "activate": ".sglang_env",
    "prepare": ".sglang_env",
}

__all__ = ["LAYOUT_ARGS", "REPLICA_KEYS", "EngineLayout", "LayoutSpecError", "parse_engine_spec", "parse_layout_spec",
           *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
