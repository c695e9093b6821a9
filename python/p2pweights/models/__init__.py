"""Built-in model shapes (config.json only; random weights, no download) for demos and benchmarks."""
from __future__ import annotations

import os

_HERE = os.path.dirname(__file__)
BUILTIN = sorted(d for d in os.listdir(_HERE) if os.path.isfile(os.path.join(_HERE, d, "config.json")))
DEFAULT = "qwen3-0.6b"


def resolve_model(name_or_path: str | None) -> str:
    """A built-in name (qwen3-0.6b, qwen3-4b, qwen3-30b-a3b, deepseek-v3) or a config dir/file path."""
    name = name_or_path or DEFAULT
    if name in BUILTIN:
        return os.path.join(_HERE, name)
    if os.path.exists(name):
        return name
    raise FileNotFoundError(
        f"model {name!r} is neither a built-in shape ({', '.join(BUILTIN)}) nor a config.json path or directory")
