"""The model registry: one :class:`ModelSpec` per architecture, looked up by its HF name.

A spec says what p2pweights knows about an architecture: the HF tensors of its checkpoint
(``schema.py``), which names are tied, how its layers split over PP stages (``stages.py``), and
which bytes-per-engine-rank model the planner's cost model uses for it (``shapes.py``). Every
entry point -- ``plan``, ``check-layout``, ``demo``, ``bench``, the sender, the replica and the
receiver -- finds a model the same way: :func:`resolve_model` turns a built-in name or a config
path into a folder, :func:`load_config` reads it, :func:`model_spec` finds its spec.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

from ..errors import UnknownModel, UnsupportedLayout
from . import schema

_HERE = os.path.dirname(__file__)
#: the built-in configs (config.json only; random weights, no download) for demos and benchmarks
BUILTIN: list[str] = sorted(d for d in os.listdir(_HERE) if os.path.isfile(os.path.join(_HERE, d, "config.json")))
DEFAULT = "qwen3-0.6b"


@dataclass(frozen=True)
class ModelSpec:
    """What p2pweights knows about one architecture.

    ``checkpoint``: the HF tensor schema (None: the replica cannot feed its loaders yet).
    ``cost``: the bytes-per-engine-rank model of ``shapes.py`` -- ``"dense"`` (Qwen3 GQA + MLP),
    ``"moe"`` (Qwen3-MoE: every layer sparse), ``"mla"`` (DeepSeek MLA + shared experts) -- or
    None when ``plan`` cannot cost it yet.
    """

    architecture: str  # the HF "architectures" name
    family: str  # a short name for messages: qwen3, qwen3-moe, deepseek-v3, ...
    checkpoint: Callable[[dict], Iterator[schema.Entry]] | None = None
    cost: str | None = None

    def tied_names(self, config: Mapping[str, Any]) -> dict[str, str]:
        """HF name -> the HF name it shares storage with (absent from the checkpoint)."""
        return schema.tied_names(dict(config))

    def num_layers(self, config: Mapping[str, Any]) -> int:
        """Decoder layers (MTP / NextN layers, numbered after them, are not counted)."""
        return int(config["num_hidden_layers"])


_REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    if spec.architecture in _REGISTRY:
        raise ValueError(f"architecture {spec.architecture} is registered twice")
    _REGISTRY[spec.architecture] = spec
    return spec


register(ModelSpec("Qwen2ForCausalLM", "qwen2", checkpoint=schema.qwen2))
register(ModelSpec("Qwen3ForCausalLM", "qwen3", checkpoint=schema.qwen3, cost="dense"))
register(ModelSpec("Qwen3MoeForCausalLM", "qwen3-moe", checkpoint=schema.qwen3_moe, cost="moe"))
register(ModelSpec("DeepseekV3ForCausalLM", "deepseek-v3", checkpoint=schema.deepseek_v3, cost="mla"))
register(ModelSpec("DeepseekV2ForCausalLM", "deepseek-v2", cost="mla"))
register(ModelSpec("Glm4MoeForCausalLM", "glm4-moe", checkpoint=schema.glm4_moe))
register(ModelSpec("Glm4MoeLiteForCausalLM", "glm4-moe-lite", checkpoint=schema.deepseek_v3))


def registered() -> dict[str, ModelSpec]:
    """Every spec, by architecture, in registration order."""
    return dict(_REGISTRY)


def architecture_of(config: Mapping[str, Any]) -> str | None:
    archs = config.get("architectures") or []
    return archs[0] if archs else None


def model_spec(architecture: str | None) -> ModelSpec:
    """The spec registered for an HF architecture name (``Qwen3ForCausalLM``, ...)."""
    spec = _REGISTRY.get(architecture or "")
    if spec is None:
        raise UnsupportedLayout(
            f"architecture {architecture} is not in the model registry; supported: {', '.join(sorted(_REGISTRY))}"
        )
    return spec


def spec_of(config: Any) -> ModelSpec:
    """The spec of a model's config (anything :func:`load_config` reads)."""
    return model_spec(architecture_of(load_config(config)))


def resolve_model(name_or_path: str | os.PathLike[str] | None) -> str:
    """A built-in name (``qwen3-0.6b``, ...) or a config folder / config.json path -> a folder or
    file holding config.json. Raises :class:`UnknownModel` (one line, listing the built-ins)."""
    name = os.fspath(name_or_path) if name_or_path is not None else DEFAULT
    if name in BUILTIN:
        return os.path.join(_HERE, name)
    path = os.path.join(name, "config.json") if os.path.isdir(name) else name
    if os.path.isfile(path):
        return name
    raise UnknownModel(
        f"no config.json at {name!r} and no built-in model of that name; pass a model folder, its "
        f"config.json, or one of the built-ins: {', '.join(BUILTIN)}"
    )


def load_config(config: Any) -> dict[str, Any]:
    """config.json as a dict, from a built-in name, a folder, a config.json path, a dict, or a
    transformers config."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, (str, os.PathLike)):
        path = resolve_model(config)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return json.load(f)
    return config.to_dict()

