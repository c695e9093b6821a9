"""The loader probe: which HF tensors reach which parameter, learned by running the replica's own
loaders on meta tensors.

Each HF input is a meta tensor with a tag. A ``TorchDispatchMode`` sees every aten op the
loaders run and passes the union of its inputs' tags to its outputs, keyed by storage, so tags
follow data through views, ``narrow``, ``cat`` (DeepSeek's ``fused_qkv_a_proj_with_mqa``),
copies, dtype casts and arithmetic. After ``load_weights``, a parameter's storage holds the tags
of every HF name whose data reached it. Nothing is allocated: all of it is on the meta device.

The same pass records which bytes of each parameter the loaders overwrite (``copy_``, ``fill_``,
``zero_`` into views of it): a parameter they do not cover completely (padding rows) is listed in
``LoaderMapping.partial`` and zeroed in the slot before each load; the others are not touched
twice, which on host slots saves a memset of every slot.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from ..errors import UnsupportedLayout
from ..models.checkpoint import TensorSpec
from .sglang_env import activate

if TYPE_CHECKING:
    import torch

# Ops whose output takes an input's shape or dtype, not its data.
_SHAPE_ONLY_OPS = {
    "empty_like",
    "zeros_like",
    "ones_like",
    "full_like",
    "rand_like",
    "randn_like",
    "new_empty",
    "new_empty_strided",
    "new_zeros",
    "new_ones",
    "new_full",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "detach",  # shares storage anyway; nothing new flows
}

# Parameters no checkpoint writes: FP8 engines' attention modules get scalar ``k_scale``/``v_scale``
# (sglang's BaseKVCacheMethod, initialized to -1) that ``process_weights_after_loading`` sets at
# ``end_weight_update``. When no HF name reaches them they are ``LoaderMapping.derived``: published
# by the engine and in the replica's ``param_specs``, but in no parameter group, never written.
_POST_PROCESSED = ("k_scale", "v_scale")

# In-place ops that overwrite every element of their target regardless of its old bytes: only
# these count towards a parameter's coverage (index_copy_, scatter_ or add_ do not).
_OVERWRITE_OPS = {"copy_", "fill_", "zero_"}


def _storage_key(t: "torch.Tensor") -> int:
    return t.untyped_storage()._cdata


class _DataFlow:
    """Built lazily (torch imports stay out of module import)."""

    def __new__(cls) -> Any:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        class DataFlow(TorchDispatchMode):
            def __init__(self) -> None:
                super().__init__()
                self.tags: dict[int, set[int]] = {}
                self.written: dict[int, list[tuple[int, int]] | None] = {}  # watched storages
                # keep every tensor seen alive so a storage key is never reused mid-probe
                self.alive: list[torch.Tensor] = []

            def tag(self, t: torch.Tensor, tag: int) -> None:
                self.tags.setdefault(_storage_key(t), set()).add(tag)
                self.alive.append(t)

            def tags_of(self, t: torch.Tensor) -> set[int]:
                return self.tags.get(_storage_key(t), set())

            def watch(self, t: torch.Tensor) -> None:
                """Record which bytes of ``t``'s storage the loaders write (its coverage)."""
                self.written[_storage_key(t)] = []
                self.alive.append(t)

            def written_bytes(self, t: torch.Tensor) -> list[tuple[int, int]] | None:
                """Byte intervals of t's storage written so far; None if some write was too
                irregular to follow (then t counts as partly written)."""
                return self.written.get(_storage_key(t))

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if self.written and func.__name__.split(".")[0] in _OVERWRITE_OPS:
                    for i, arg in enumerate(func._schema.arguments):
                        if arg.alias_info is not None and arg.alias_info.is_write:
                            value = args[i] if i < len(args) else kwargs.get(arg.name)
                            for x in _tensors(value):
                                key = _storage_key(x)
                                if self.written.get(key) is not None:
                                    spans = _byte_intervals(x)
                                    if spans is None:
                                        self.written[key] = None
                                    else:
                                        self.written[key] += spans
                if func.__name__.split(".")[0] in _SHAPE_ONLY_OPS:
                    return out
                tags = self.tags
                flowing: set[int] = set()
                for leaf in _tensors((args, kwargs.values())):
                    found = tags.get(_storage_key(leaf))
                    if found:
                        flowing |= found
                if flowing:
                    targets = list(_tensors(out))
                    # in-place and out= ops write into their mutable arguments
                    for i, arg in enumerate(func._schema.arguments):
                        if arg.alias_info is not None and arg.alias_info.is_write:
                            value = args[i] if i < len(args) else kwargs.get(arg.name)
                            targets += _tensors(value)
                    for x in targets:
                        tags.setdefault(_storage_key(x), set()).update(flowing)
                        self.alive.append(x)
                return out

        def _tensors(value: Any) -> list:
            """Tensors in an op's arguments or results: flat, or inside lists/tuples (cat)."""
            if isinstance(value, torch.Tensor):
                return [value]
            if isinstance(value, (list, tuple, type({}.values()))):
                found = []
                for v in value:
                    found += _tensors(v)
                return found
            return []

        return DataFlow()


def _byte_intervals(t: "torch.Tensor", limit: int = 1 << 16) -> list[tuple[int, int]] | None:
    """The byte intervals of its storage a (meta) view covers: innermost contiguous dimensions
    merged into one block, the others enumerated; None past ``limit`` blocks."""
    if t.numel() == 0:
        return []
    size = t.element_size()
    dims = sorted(((n, st) for n, st in zip(t.shape, t.stride()) if n != 1), key=lambda d: -d[1])
    block = 1
    while dims and dims[-1][1] == block:
        block *= dims.pop()[0]
    count = 1
    for n, _ in dims:
        count *= n
    if count > limit:
        return None
    starts = [t.storage_offset()]
    for n, st in dims:
        starts = [s + i * st for s in starts for i in range(n)]
    return [(s * size, (s + block) * size) for s in starts]


def _covers(spans: list[tuple[int, int]] | None, nbytes: int) -> bool:
    if spans is None:
        return False
    end = 0
    for a, b in sorted(spans):
        if a > end:
            return False
        end = max(end, b)
    return end >= nbytes


@dataclass
class LoaderMapping:
    """What the probe learned for one replica: which HF names feed which parameter."""

    sources: dict[str, list[str]]  # parameter name -> HF names whose data reaches it
    param_specs: dict[str, TensorSpec]  # parameter name -> shape/dtype on the engine rank
    hf_specs: dict[str, TensorSpec]  # every HF name the probe fed
    ignored: list[str] = field(default_factory=list)  # HF names the loaders drop for this rank
    # parameters the loaders leave partly unwritten (padding rows): zeroed in the slot before each
    # load so no stale bytes reach the engine. None: not known, zero every parameter.
    partial: list[str] | None = None
    # parameters post-processing sets and no HF name reaches (attention k_scale/v_scale): in
    # param_specs (the engine publishes them), in no group (a sender never writes them)
    derived: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "sources": self.sources,
            "param_specs": {k: [list(v.shape), v.dtype] for k, v in self.param_specs.items()},
            "hf_specs": {k: [list(v.shape), v.dtype] for k, v in self.hf_specs.items()},
            "ignored": self.ignored,
            "partial": self.partial,
            "derived": self.derived,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "LoaderMapping":
        def specs(d: Mapping[str, Any]) -> dict[str, TensorSpec]:
            return {k: TensorSpec(tuple(s), dt) for k, (s, dt) in d.items()}

        return cls(
            sources={k: list(v) for k, v in data["sources"].items()},
            param_specs=specs(data["param_specs"]),
            hf_specs=specs(data["hf_specs"]),
            ignored=list(data["ignored"]),
            partial=None if data.get("partial") is None else list(data["partial"]),
            derived=list(data.get("derived") or []),
        )


def probe_loaders(model: "torch.nn.Module", hf_specs: Mapping[str, TensorSpec], *,
                  context: Callable[[Any], Any] = activate, engine: str = "") -> LoaderMapping:
    """Run ``model.load_weights`` on meta HF inputs and record the data flow into parameters.
    ``context(model)``: what the engine's loaders need active while they run (sglang's, by default;
    the vLLM replica passes its own); ``engine`` names the engine kind in errors.

    Raises :class:`UnsupportedLayout` naming every parameter no HF name reaches: the engine
    holds it, so a sender could never write it.
    """
    import torch

    names = list(hf_specs)
    flow = _DataFlow()
    inputs = []
    for i, name in enumerate(names):
        spec = hf_specs[name]
        t = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device="meta")
        flow.tag(t, i)
        inputs.append((name, t))
    params = dict(model.named_parameters())
    if any(p.device.type != "meta" for p in params.values()):
        raise ValueError("probe_loaders needs a replica on the meta device")
    for p in params.values():
        flow.watch(p)
    with context(model), flow:
        model.load_weights(iter(inputs))
    before = {n: _storage_key(p) for n, p in params.items()}
    params = dict(model.named_parameters())  # a loader may have replaced a parameter's data
    # a parameter counts as fully written only if it kept its storage and the writes into it
    # cover every byte; anything else is zeroed before each load (conservative)
    partial = [n for n, p in params.items()
               if before.get(n) != _storage_key(p) or p.storage_offset() != 0
               or not _covers(flow.written_bytes(p), p.numel() * p.element_size())]
    sources: dict[str, list[str]] = {}
    reached: set[int] = set()
    for pname, p in params.items():
        tags = flow.tags_of(p)
        reached |= tags
        sources[pname] = [names[i] for i in sorted(tags)]
    derived = [p for p, s in sources.items() if not s and p.rsplit(".", 1)[-1] in _POST_PROCESSED]
    for p in derived:
        del sources[p]
    uncovered = [p for p, s in sources.items() if not s]
    if uncovered:
        shown = ", ".join(uncovered[:8]) + (f" (+{len(uncovered) - 8} more)" if len(uncovered) > 8 else "")
        raise UnsupportedLayout(
            f"{len(uncovered)} parameter(s) of the {engine + ' ' if engine else ''}engine rank are reached by no "
            f"HF tensor, "
            f"so a sender could never write them: {shown}"
        )
    return LoaderMapping(
        sources=sources,
        param_specs={n: TensorSpec(tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in params.items()},
        hf_specs=dict(hf_specs),
        ignored=[names[i] for i in range(len(names)) if i not in reached],
        partial=[p for p in partial if p not in derived],
        derived=derived,
    )
