"""Every knob: a keyword argument, else a ``P2PW_`` environment variable, else the default.

| env var | keyword | default | meaning |
| --- | --- | --- | --- |
| P2PW_BUFFER_SIZE | buffer_size | 512MiB | bytes per transfer slot (raised to the largest parameter group) |
| P2PW_NUM_SLOTS | num_slots | 2 | transfer slots (2 = double buffering) |
| P2PW_TRANSFER_TIMEOUT | transfer_timeout | 30 | seconds a write may run before it is cancelled |
| P2PW_TRANSPORT | transport | mooncake | mooncake or nixl |
| P2PW_NIXL_BACKEND | nixl_backend | UCX | NIXL plugin (also read: SGLANG_REMOTE_INSTANCE_NIXL_BACKEND) |
| P2PW_BUFFER_DEVICE | buffer_device | cpu | where slots live: cpu (pinned host) or cuda |
| P2PW_PIN | pin | auto | host slot pinning: auto, cuda, mlock, none |
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(value: str | int) -> int:
    """'512MiB' -> 536870912; plain integers are bytes."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size; use bytes or a unit such as 64MiB, 1GiB, 500MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{int(n)} B"


TRANSPORTS = ("mooncake", "nixl")


@dataclass(frozen=True)
class Settings:
    buffer_size: int = field(default=512 << 20, metadata={"env": "P2PW_BUFFER_SIZE", "parse": parse_size})
    num_slots: int = field(default=2, metadata={"env": "P2PW_NUM_SLOTS", "parse": int})
    transfer_timeout: float = field(default=30.0, metadata={"env": "P2PW_TRANSFER_TIMEOUT", "parse": float})
    transport: str = field(default="mooncake", metadata={"env": "P2PW_TRANSPORT", "parse": str})
    nixl_backend: str = field(default="UCX", metadata={"env": "P2PW_NIXL_BACKEND", "parse": str,
                                                       "also": "SGLANG_REMOTE_INSTANCE_NIXL_BACKEND"})
    buffer_device: str = field(default="cpu", metadata={"env": "P2PW_BUFFER_DEVICE", "parse": str})
    pin: str = field(default="auto", metadata={"env": "P2PW_PIN", "parse": str})

    def __post_init__(self) -> None:
        if self.buffer_size <= 0:
            raise ValueError(f"buffer_size must be positive, got {self.buffer_size} (P2PW_BUFFER_SIZE)")
        if self.num_slots < 1:
            raise ValueError(f"num_slots must be at least 1, got {self.num_slots} (P2PW_NUM_SLOTS)")
        if not self.transfer_timeout > 0:
            raise ValueError(f"transfer_timeout must be positive, got {self.transfer_timeout} (P2PW_TRANSFER_TIMEOUT)")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {self.transport!r} (P2PW_TRANSPORT)")
        if self.buffer_device not in ("cpu", "cuda") and not self.buffer_device.startswith("cuda:"):
            raise ValueError(f"buffer_device must be cpu or cuda[:N], got {self.buffer_device!r} (P2PW_BUFFER_DEVICE)")
        if self.pin not in ("auto", "cuda", "mlock", "none"):
            raise ValueError(f"pin must be auto, cuda, mlock or none, got {self.pin!r} (P2PW_PIN)")


def settings(**overrides: Any) -> Settings:
    """Keyword arguments win over environment variables, which win over defaults. None = unset."""
    values: dict[str, Any] = {}
    for f in fields(Settings):
        if overrides.get(f.name) is not None:
            values[f.name] = overrides[f.name]
            continue
        for env in (f.metadata["env"], f.metadata.get("also")):
            raw = os.environ.get(env) if env else None
            if raw:
                try:
                    values[f.name] = f.metadata["parse"](raw)
                except ValueError as e:
                    raise ValueError(f"{env}={raw!r}: {e}") from None
                break
    unknown = set(overrides) - {f.name for f in fields(Settings)}
    if unknown:
        raise TypeError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    return Settings(**values)
