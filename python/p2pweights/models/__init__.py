"""The model registry: what p2pweights knows about each architecture, and the built-in configs.

    resolve_model("qwen3-0.6b" | CONFIG_DIR | CONFIG_JSON) -> a folder or file holding config.json
    load_config(name, path, dict or transformers config) -> dict
    model_spec("Qwen3ForCausalLM") / spec_of(config) -> ModelSpec      # registry.py
    checkpoint_tensors(config) -> {hf_name: TensorSpec}                # checkpoint.py (schema.py)
    stage_layers / stage_of / stage_hf_names                           # stages.py: PP stage of a tensor
    model_shape(config) / engine_rank_bytes(shape, layout)             # shapes.py: bytes per engine rank

The built-in configs (config.json only; random weights, no download) serve demos and benchmarks.
"""
from __future__ import annotations

from .registry import (
    BUILTIN,
    DEFAULT,
    ModelSpec,
    UnknownModel,
    load_config,
    model_spec,
    register,
    registered,
    resolve_model,
    spec_of,
)
from .stages import stage_hf_names, stage_layers, stage_of, writer_hf_names, writer_layers

__all__ = [
    "BUILTIN",
    "DEFAULT",
    "ModelSpec",
    "UnknownModel",
    "load_config",
    "model_spec",
    "register",
    "registered",
    "resolve_model",
    "spec_of",
    "stage_hf_names",
    "stage_layers",
    "stage_of",
    "writer_hf_names",
    "writer_layers",
]
