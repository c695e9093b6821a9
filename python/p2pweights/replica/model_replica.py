"""One meta replica per (model, shard layout, engine rank), its loader mapping, and filling slots.

``ModelReplicas.get(config, engine, rank)`` returns the process's one :class:`ModelReplica` of
that shard layout (invariant 7): built on the meta device, probed once, and cached in memory and
(optionally) on disk. ``ModelReplica.load_group`` runs the replica's own loaders on one
complete parameter group, writing straight into a transfer slot. There is never a full copy of
the model: only meta parameters, the slot, and the group's HF inputs.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, Sequence

from .. import _native
from ..errors import LayoutMismatch, MissingTensors, UnknownParameter
from ..models import load_config, resolve_model
from ..models.checkpoint import TensorSpec, checkpoint_tensors
from ..models.engine_layout import EngineLayout
from ..models.sglang_version import sglang_version
from ..settings import value
from . import sglang_env
from .draft_model import build_role_model
from .groups import SLOT_ALIGNMENT, ParameterGroup, SlotRegion, build_groups
from .probe import LoaderMapping, probe_loaders
from .sglang_ue8m0 import Ue8m0Replay, load_post_processed

if TYPE_CHECKING:
    import torch

_CACHE_FORMAT = 3  # 3: LoaderMapping.derived (FP8 k_scale/v_scale)


@dataclass(frozen=True)
class ReplicaKey:
    """Model config hash + shard layout + engine rank + role ("target", or "draft": replica/roles.py)."""

    config_hash: str
    layout: EngineLayout
    rank: int
    role: str = "target"

    def digest(self) -> str:
        text = json.dumps(  # _native.__version__ is the package's (p2pweights/__init__.py reads it there)
            [_CACHE_FORMAT, self.config_hash, self.layout.args, self.rank, self.role, sglang_version(),
             _native.__version__],
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(text.encode()).hexdigest()[:24]


def config_hash(config: Any) -> str:
    return hashlib.sha256(json.dumps(load_config(config), sort_keys=True).encode()).hexdigest()[:16]


class ModelReplica:
    """The sglang model of one engine rank on meta, and what its loaders do with HF tensors."""

    #: what the engine's loaders need active while they run (the vLLM replica has its own)
    _loader_context = staticmethod(sglang_env.activate)

    def __init__(self, config: Any, engine: EngineLayout, rank: int, mapping: LoaderMapping,
                 model: "torch.nn.Module | None" = None, key: ReplicaKey | None = None):
        self.config_dir = sglang_env.config_dir_of(config)
        self.engine = engine
        self.rank = rank
        self.mapping = mapping
        self.key = key
        self.role = key.role if key is not None else "target"  # "draft": the engine's MTP draft model
        self._model = model
        self._model_lock = threading.Lock()
        self._sites: dict[str, list[tuple[Any, str]]] | None = None
        self._derived_modules: dict[int, list[Any]] = {}  # group index -> modules its loaders add tensors to
        self.groups: list[ParameterGroup] = build_groups(mapping.sources, mapping.param_specs)
        self._group_of_hf: dict[str, ParameterGroup] = {}
        for g in self.groups:
            for hf in g.hf_names:
                self._group_of_hf[hf] = g
        self._ignored = frozenset(mapping.ignored)
        self._partial = None if mapping.partial is None else frozenset(mapping.partial)

    # -- connect-time facts -------------------------------------------------------------------
    @property
    def model(self) -> "torch.nn.Module":
        """The meta model; built on first use when the mapping came from the disk cache."""
        with self._model_lock:
            if self._model is None:
                self._model = build_role_model(self.config_dir, self.engine, self.rank, self.role)
                built = {n: TensorSpec(tuple(p.shape), str(p.dtype).removeprefix("torch."))
                         for n, p in self._model.named_parameters()}
                if built != self.mapping.param_specs:
                    raise LayoutMismatch(
                        f"replica of {self.engine.describe()} rank {self.rank} no longer matches its cached "
                        "mapping (different sglang build?); clear the replica cache"
                    )
            return self._model

    @property
    def hf_specs(self) -> dict[str, TensorSpec]:
        """Every HF tensor of the checkpoint the probe fed (the names a sender may push)."""
        return self.mapping.hf_specs

    @property
    def param_specs(self) -> dict[str, TensorSpec]:
        """Engine parameter name → shape and dtype on this rank (``.nbytes`` = numel × size)."""
        return self.mapping.param_specs

    @property
    def ignored_hf_names(self) -> frozenset[str]:
        """HF names whose data this rank does not hold (other EP ranks' experts, MTP layers of a
        target model); pushing them is fine and writes nothing here."""
        return self._ignored

    @property
    def param_names(self) -> list[str]:
        return list(self.mapping.param_specs)

    def param_nbytes(self, name: str) -> int:
        """numel × element size of an engine parameter (compare with what the engine published)."""
        try:
            return self.mapping.param_specs[name].nbytes
        except KeyError:
            raise LayoutMismatch(f"parameter {name} is not held by {self.engine.describe()} rank {self.rank}") from None

    def param_nbytes_all(self) -> dict[str, int]:
        return {n: s.nbytes for n, s in self.mapping.param_specs.items()}

    @property
    def total_nbytes(self) -> int:
        return sum(s.nbytes for s in self.mapping.param_specs.values())

    @property
    def largest_group_nbytes(self) -> int:
        """Slot bytes the largest parameter group needs: the smallest usable slot size."""
        return max(g.nbytes for g in self.groups)

    def group_of(self, hf_name: str) -> ParameterGroup | None:
        """The group an HF tensor feeds; None if this rank does not hold its data (another
        expert-parallel rank's expert, an MTP layer the target model skips)."""
        group = self._group_of_hf.get(hf_name)
        if group is None and hf_name not in self._ignored:
            raise UnknownParameter(
                f"HF tensor {hf_name} is not in the checkpoint of {self.engine.describe()} rank {self.rank}'s model"
            )
        return group

    # -- update time ----------------------------------------------------------------------------
    def load_group(
        self, group: ParameterGroup, hf_tensors: Mapping[str, "torch.Tensor"], slot: "torch.Tensor",
        offset: int = 0,
    ) -> list[SlotRegion]:
        """Run the replica's loaders on one complete group, writing its parameters into ``slot``.

        ``slot`` is a 1-D uint8 tensor (a view of a transfer slot, host or GPU memory); the group
        takes ``group.nbytes`` from ``offset`` on (a multiple of 256, so several groups can share
        a slot). Returns (parameter name, offset in ``slot``, bytes) per parameter. The
        parameters point into the slot only while the loaders run; they keep their class and
        attributes, and are meta again afterwards. HF tensors may be on the CPU or the slot's device.
        """
        return self.load_groups([(group, offset)], hf_tensors, slot)

    def load_groups(
        self, placed: Sequence[tuple[ParameterGroup, int]], hf_tensors: Mapping[str, "torch.Tensor"],
        slot: "torch.Tensor",
    ) -> list[SlotRegion]:
        """:meth:`load_group` for several complete groups at (group, offset) in one slot,
        with ONE call of the model's ``load_weights``: sglang's loaders pay a fixed cost per call
        (they rebuild the parameter table), which dominates when a GPU does the copies."""
        import torch

        want = [n for g, _ in placed for n in g.hf_names]
        missing = [n for n in want if n not in hf_tensors]
        if missing:
            raise MissingTensors(f"parameter groups {[g.index for g, _ in placed]} still miss {missing[:8]}")
        extra = [n for n in hf_tensors if n not in set(want)]
        if extra:
            raise UnknownParameter(f"HF tensors {extra[:8]} do not belong to parameter groups {[g.index for g, _ in placed]}")
        if slot.dtype != torch.uint8 or slot.dim() != 1:
            raise LayoutMismatch(f"slot must be a 1-D uint8 tensor, got {slot.dtype} {tuple(slot.shape)}")
        regions = []
        for group, offset in placed:
            if offset % SLOT_ALIGNMENT:
                raise LayoutMismatch(f"group offset {offset} in the slot is not a multiple of {SLOT_ALIGNMENT}")
            if slot.numel() < offset + group.nbytes:
                raise LayoutMismatch(f"slot of {slot.numel()} bytes has no room for group {group.index} "
                                     f"({group.nbytes} bytes) at offset {offset}")
            regions += [SlotRegion(r.param_name, offset + r.offset, r.nbytes) for r in group.regions]
        model = self.model
        if self._sites is None:
            self._sites = sglang_env.parameter_sites(model)
            self._first_sites = _first_sites(self._sites)
            self._params = dict(model.named_parameters())  # the meta parameters, restored after every load
        params = self._params
        # padding rows some loaders leave untouched must not carry old bytes: the probe knows
        # which parameters those are; without that knowledge, one fill per run of adjacent groups
        partial = self._partial
        if partial is None:
            for start, end in _adjacent_spans(placed):
                slot[start:end].zero_()
        views, installed = [], []
        for region in regions:
            old = params[region.param_name]
            spec = self.mapping.param_specs[region.param_name]
            view = slot[region.offset:region.offset + region.nbytes].view(getattr(torch, spec.dtype)).view(spec.shape)
            if partial is not None and region.param_name in partial:
                view.zero_()
            new = sglang_env.rebuild_parameter(old, view)
            sglang_env.install_parameter(self._sites[region.param_name], new)
            views.append(view)
            installed.append((region.param_name, old, new))
        # Which modules a group's loaders hang derived tensors on is learned on its first load (a
        # scan of every module under its parameters); later loads save and restore only those.
        learning = [g for g, _ in placed if g.index not in self._derived_modules]
        watched: dict[int, Any] = {}
        for g, _ in placed:
            for m in self._derived_modules.get(g.index, ()):
                watched.setdefault(id(m), m)
        scanned = {g.index: _DerivedState.candidates(model, g.params) for g in learning}
        for modules in scanned.values():
            for m in modules:
                watched.setdefault(id(m), m)
        derived = _DerivedState(watched.values())
        try:
            with self._loader_context(model), _named_parameters_from_sites(model, self._first_sites):
                model.load_weights(iter([(n, hf_tensors[n]) for n in want]))
            for region, view in zip(regions, views):
                # a loader may have rebound .data (or replaced the parameter): copy it back
                module, attr = self._sites[region.param_name][0]
                current = module._parameters[attr]
                if current.data.data_ptr() != view.data_ptr():
                    if tuple(current.shape) != tuple(view.shape) or current.dtype != view.dtype:
                        raise LayoutMismatch(
                            f"loader of {region.param_name} produced {tuple(current.shape)} {current.dtype}, "
                            f"the engine holds {tuple(view.shape)} {view.dtype}"
                        )
                    view.copy_(current.data)
            if learning:
                changed = {id(m) for m in derived.changed()}
                for index, modules in scanned.items():
                    self._derived_modules[index] = [m for m in modules if id(m) in changed]
        finally:
            for name, old, _ in installed:
                sglang_env.install_parameter(self._sites[name], old)
            derived.restore()
        return regions


def _first_sites(sites: Mapping[str, list[tuple[Any, str]]]) -> list[tuple[str, tuple[Any, str]]]:
    """(parameter name, its first (module, attribute) site), in ``named_parameters`` order."""
    return [(name, entries[0]) for name, entries in sites.items()]


@contextmanager
def _named_parameters_from_sites(model: "torch.nn.Module", first: list[tuple[str, tuple[Any, str]]]) -> Iterator[None]:
    """sglang's loaders start with ``dict(self.named_parameters())``: a walk of every module that
    costs about a millisecond per call, most of a small batch's load. While they run, the model's
    plain ``named_parameters()`` reads the same (name, parameter) pairs, in the same order, from
    the sites known since the first load (``_first_sites``); any other form goes to torch."""
    walk = model.named_parameters

    def named_parameters(*args: Any, **kwargs: Any) -> Iterator[tuple[str, Any]]:
        if args or kwargs:
            return walk(*args, **kwargs)
        return iter([(name, module._parameters[attr]) for name, (module, attr) in first])

    model.__dict__["named_parameters"] = named_parameters
    try:
        yield
    finally:
        del model.__dict__["named_parameters"]


def _adjacent_spans(placed: Sequence[tuple[ParameterGroup, int]]) -> list[tuple[int, int]]:
    """[start, end) byte spans covering the placed groups, merged where one group's aligned end is
    the next one's offset. Nothing outside the groups is touched (another engine rank's groups
    may share the slot)."""
    spans: list[list[int]] = []
    for group, offset in sorted(placed, key=lambda x: x[1]):
        end = offset + group.nbytes
        if spans and -(-spans[-1][1] // SLOT_ALIGNMENT) * SLOT_ALIGNMENT == offset:
            spans[-1][1] = end
        else:
            spans.append([offset, end])
    return [(a, b) for a, b in spans]


class _DerivedState:
    """Loaders also compute derived tensors (DeepSeek's w_kc/w_vc from kv_b_proj) as plain module
    attributes. The engine recomputes those itself at end_weight_update; the replica must not keep
    them pointing into a slot, so they are put back after each load."""

    def __init__(self, modules: Iterable[Any]):
        self.saved: list[tuple[Any, dict[str, Any]]] = [(m, _tensor_attrs(m)) for m in modules]

    @staticmethod
    def candidates(model: "torch.nn.Module", params: Iterable[str]) -> list[Any]:
        """Every module a group's loaders could hang derived tensors on: the owning module's
        parent (self_attn for kv_b_proj.weight) and everything under it, never the whole model."""
        prefixes = {p.rsplit(".", 2)[0] if p.count(".") >= 3 else p.rsplit(".", 1)[0] for p in params}
        found: dict[int, Any] = {}
        for prefix in prefixes:
            try:
                module = model.get_submodule(prefix)
            except AttributeError:
                continue
            for sub in module.modules():
                found.setdefault(id(sub), sub)
        return list(found.values())

    def changed(self) -> list[Any]:
        """The modules whose tensor attributes the loaders added or replaced."""
        out = []
        for module, state in self.saved:
            now = _tensor_attrs(module)
            if now.keys() != state.keys() or any(now[k] is not v for k, v in state.items()):
                out.append(module)
        return out

    def restore(self) -> None:
        for module, state in self.saved:
            for k, v in list(vars(module).items()):
                if k not in state and _is_plain_tensor(v):
                    delattr(module, k)
            for k, v in state.items():
                object.__setattr__(module, k, v)


def _is_plain_tensor(v: Any) -> bool:
    import torch

    return isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)


def _tensor_attrs(module: Any) -> dict[str, Any]:
    return {k: v for k, v in vars(module).items() if _is_plain_tensor(v)}


class BlackwellModelReplica(ModelReplica):
    """A Blackwell engine rank's replica (``gpu_arch=sm100``): its groups are laid out by the
    engine's post-processed shapes (packed int32 scales), and its loads replay sglang's FP8
    post-processing on the loaded bytes (:mod:`.sglang_ue8m0`)."""

    def __init__(self, config: Any, engine: EngineLayout, rank: int, mapping: LoaderMapping,
                 model: "torch.nn.Module | None" = None, key: ReplicaKey | None = None):
        self.loading = ModelReplica(config, engine, rank, mapping, model=model, key=key)  # the loaders' shapes
        self.replay = Ue8m0Replay(self.loading.model, engine)
        published = dataclasses.replace(mapping, param_specs={n: self.replay.specs.get(n, s)
                                                              for n, s in mapping.param_specs.items()})
        super().__init__(config, engine, rank, published, model=self.loading.model, key=key)

    @property
    def model(self) -> "torch.nn.Module":
        return self.loading.model

    @property
    def replayed(self) -> dict[str, str]:
        """Module name -> the transforms replayed on send (``sglang_ue8m0.TRANSFORMS``)."""
        return dict(self.replay.transforms)

    def not_a_copy(self, group: ParameterGroup) -> str | None:
        return self.replay.why_not_a_copy(group.params)

    def load_groups(self, placed: Sequence[tuple[ParameterGroup, int]], hf_tensors: Mapping[str, "torch.Tensor"],
                    slot: "torch.Tensor") -> list[SlotRegion]:
        return load_post_processed(self.loading, self.replay, placed, hf_tensors, slot)


def replica_class(engine: EngineLayout) -> type:
    """:class:`ModelReplica`, or for a Blackwell layout :class:`BlackwellModelReplica`."""
    return ModelReplica if engine.gpu_arch is None else BlackwellModelReplica


class ModelReplicas:
    """The process's replicas, one per (model config, shard layout, engine rank).

    ``cache_dir`` (or ``P2PW_REPLICA_CACHE_DIR``) also keeps each loader mapping on disk, keyed
    by a hash of the model config, the layout, the rank and the sglang version; a process that
    finds it there skips the probe and builds the meta model only when it first loads a group.
    """

    def __init__(self, cache_dir: str | None = None):
        self.cache_dir = cache_dir if cache_dir is not None else value("P2PW_REPLICA_CACHE_DIR") or None
        self._replicas: dict[ReplicaKey, ModelReplica] = {}
        self._lock = threading.Lock()
        self.builds = 0  # replicas built and probed in this process
        self.disk_hits = 0
        self.last_timings: dict[str, float] = {}
        self.seconds: dict[str, float] = {}  # the last_timings of every build (and disk_s), summed

    def __len__(self) -> int:
        return len(self._replicas)

    def get(self, config: Any, engine: EngineLayout, rank: int,
            hf_specs: Mapping[str, TensorSpec] | None = None, role: str = "target") -> ModelReplica:
        """The replica of engine rank ``rank`` of an engine with layout ``engine`` (built once).

        ``hf_specs`` defaults to the config's published checkpoint (``checkpoint_tensors``).
        ``config`` may be a built-in model name, a config folder or file, or a config object.
        """
        if isinstance(config, (str, os.PathLike)):
            config = resolve_model(config)
        engine.check_supported()
        key = ReplicaKey(config_hash(config), engine, rank, role)  # role: replica/roles.py
        with self._lock:
            replica = self._replicas.get(key)
            if replica is not None:
                return replica
            replica = self._load_from_disk(config, engine, rank, key)
            if replica is None:
                replica = self._build(config, engine, rank, key, hf_specs)
            replica.plan_cache_dir = self.cache_dir  # its copy plans are kept there too (copyplans/store.py)
            self._replicas[key] = replica
            return replica

    def cached(self, config: Any, engine: EngineLayout, rank: int, role: str = "target") -> bool:
        """Whether :meth:`get` would find this replica in the process or in the disk cache (and so
        build nothing, import no sglang)."""
        if isinstance(config, (str, os.PathLike)):
            config = resolve_model(config)
        key = ReplicaKey(config_hash(config), engine, rank, role)
        with self._lock:
            if key in self._replicas:
                return True
        path = self._cache_path(key)
        return bool(path) and os.path.exists(path)

    def clear(self) -> None:
        with self._lock:
            self._replicas.clear()

    def _build(self, config: Any, engine: EngineLayout, rank: int, key: ReplicaKey,
               hf_specs: Mapping[str, TensorSpec] | None) -> ModelReplica:
        t_import = time.perf_counter()
        sglang_env.prepare()  # once per process; timed apart from the model build
        t0 = time.perf_counter()
        model = build_role_model(config, engine, rank, key.role)
        t1 = time.perf_counter()
        mapping = probe_loaders(model, hf_specs if hf_specs is not None else checkpoint_tensors(config))
        t2 = time.perf_counter()
        replica = replica_class(engine)(config, engine, rank, mapping, model=model, key=key)
        self.last_timings = {"sglang_import_s": t0 - t_import, "build_s": t1 - t0, "probe_s": t2 - t1,
                             "groups_s": time.perf_counter() - t2}
        for k, v in self.last_timings.items():
            self.seconds[k] = self.seconds.get(k, 0.0) + v
        self.builds += 1
        self._save_to_disk(key, mapping)
        return replica

    def _cache_path(self, key: ReplicaKey) -> str | None:
        if not self.cache_dir:
            return None
        return os.path.join(self.cache_dir, f"replica-{key.digest()}.json")

    def _load_from_disk(self, config: Any, engine: EngineLayout, rank: int, key: ReplicaKey) -> ModelReplica | None:
        path = self._cache_path(key)
        if not path or not os.path.exists(path):
            return None
        t0 = time.perf_counter()
        try:
            with open(path) as f:
                mapping = LoaderMapping.from_json(json.load(f))
        except (OSError, ValueError, KeyError):
            return None  # a damaged cache entry is rebuilt, never trusted
        self.disk_hits += 1
        replica = replica_class(engine)(config, engine, rank, mapping, key=key)
        self.seconds["disk_s"] = self.seconds.get("disk_s", 0.0) + time.perf_counter() - t0
        return replica

    def _save_to_disk(self, key: ReplicaKey, mapping: LoaderMapping) -> None:
        path = self._cache_path(key)
        if not path:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(mapping.to_json(), f)
        os.replace(tmp, path)


_DEFAULT: ModelReplicas | None = None


def model_replicas() -> ModelReplicas:
    """The process-wide :class:`ModelReplicas` (invariant 7: one replica per shard layout)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = ModelReplicas()
    return _DEFAULT
