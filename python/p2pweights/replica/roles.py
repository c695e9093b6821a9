"""Replica roles: an engine rank that runs a speculative draft holds two models' weights.

Roles: ``"target"`` (the served model) and ``"draft"`` (the MTP / NextN draft model sglang builds
from the target's own checkpoint when ``speculative_algorithm`` is NEXTN or EAGLE; see
:mod:`.draft_model`). Each role has its own :class:`~.replica.ModelReplica` (the replica key
includes the role), its own loader probe and parameter groups.

What the engine rank publishes and what a sender writes use **role-qualified parameter names**:
the target's names as they are, the draft's with the prefix ``"draft."``
(``draft.model.decoder.mlp.experts.w13_weight``). Parameters the draft shares with the target
(its embedding and LM head ARE the target's tensors after sglang's ``set_embed_and_head``) are
the target's only: not published twice, written once.

:class:`RankRoles` joins the roles of one engine rank into the one object a sender prepares: its
groups are every role's groups (a group whose HF inputs some other role's group also reads is
merged with it, so a tensor both roles load is loaded by both and written to both roles' memory),
its ``param_specs`` are role-qualified, and :meth:`RankRoles.load_groups` runs each role's own
loaders. An engine without a draft gets its target replica, unchanged. :class:`RankRoles` is
engine-neutral: a vLLM engine's MTP draft joins its target through :func:`join_roles`
(:func:`.vllm_replica.vllm_rank_replica`).
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..errors import LayoutMismatch, MissingTensors, UnknownParameter
from ..models.checkpoint import TensorSpec
from ..models.engine_layout import EngineLayout
from ..models.layout_refusals import draft_algorithm
from .draft_model import draft_architecture
from .groups import SLOT_ALIGNMENT, ParameterGroup, SlotRegion

if TYPE_CHECKING:
    import torch

    from .model_replica import ModelReplica, ModelReplicas

#: prefix of the draft role's parameter names in publications, slots and checks
DRAFT_PREFIX = "draft."


def qualified(role: str, name: str) -> str:
    """A role's parameter name as published: the target's as is, the draft's with ``draft.``."""
    return name if role == "target" else f"{role}.{name}"


def roles_of(config: Any, engine: EngineLayout) -> tuple[str, ...]:
    """The roles an engine rank of ``engine`` holds: ("target",) or ("target", "draft"). A draft the
    replica cannot build raises :class:`~p2pweights.errors.UnsupportedLayout` with the reason."""
    args = {**engine.extra, **dict(engine.args)}
    if draft_algorithm(args) is None:
        return ("target",)
    draft_architecture(config, engine)  # refuses, naming why, what it cannot build
    return ("target", "draft")


@dataclass(frozen=True)
class _Member:
    role: str
    group: ParameterGroup  # of that role's replica
    offset: int            # within the joined group


class RankRoles:
    """Every role of one engine rank as one replica-like object (what ``WeightSender`` prepares):
    ``groups``, ``hf_specs``, ``param_specs`` (role-qualified), ``group_of``, ``load_groups``."""

    def __init__(self, replicas: Mapping[str, "ModelReplica"]):
        self.roles: dict[str, ModelReplica] = dict(replicas)
        target = self.roles["target"]
        self.engine, self.rank, self.key = target.engine, target.rank, tuple(r.key for r in self.roles.values())
        self.role = "+".join(self.roles)
        self.hf_specs: dict[str, TensorSpec] = dict(target.hf_specs)
        for replica in self.roles.values():
            for name, spec in replica.hf_specs.items():
                if self.hf_specs.setdefault(name, spec) != spec:
                    raise LayoutMismatch(f"HF tensor {name}: the roles of {self.engine.describe()} rank {self.rank} "
                                         f"read it as {self.hf_specs[name]} and {spec}", parameter=name)
        self.param_specs: dict[str, TensorSpec] = {
            qualified(role, n): s for role, r in self.roles.items() for n, s in r.param_specs.items()}
        self.groups, self._members = _join_groups(self.roles)
        self._group_of_hf = {hf: g for g in self.groups for hf in g.hf_names}
        ignored = [set(r.ignored_hf_names) for r in self.roles.values()]
        self.ignored_hf_names = frozenset(set.intersection(*ignored))

    # -- what a sender reads at connect ------------------------------------------------------------
    @property
    def param_names(self) -> list[str]:
        return list(self.param_specs)

    def param_nbytes(self, name: str) -> int:
        try:
            return self.param_specs[name].nbytes
        except KeyError:
            raise LayoutMismatch(f"parameter {name} is not held by {self.engine.describe()} rank {self.rank}") from None

    def param_nbytes_all(self) -> dict[str, int]:
        return {n: s.nbytes for n, s in self.param_specs.items()}

    @property
    def total_nbytes(self) -> int:
        return sum(s.nbytes for s in self.param_specs.values())

    @property
    def largest_group_nbytes(self) -> int:
        return max(g.nbytes for g in self.groups)

    def group_of(self, hf_name: str) -> ParameterGroup | None:
        group = self._group_of_hf.get(hf_name)
        if group is None and hf_name not in self.ignored_hf_names:
            raise UnknownParameter(f"HF tensor {hf_name} is not in the checkpoint of {self.engine.describe()} "
                                   f"rank {self.rank}'s models ({', '.join(self.roles)})")
        return group

    # -- update time -------------------------------------------------------------------------------
    def load_groups(self, placed: Sequence[tuple[ParameterGroup, int]], hf_tensors: Mapping[str, "torch.Tensor"],
                    slot: "torch.Tensor") -> list[SlotRegion]:
        """Each role's loaders on its part of the placed groups (one ``load_weights`` call per role);
        regions come back role-qualified, in the groups' order."""
        per_role: dict[str, tuple[list[tuple[ParameterGroup, int]], dict[str, Any]]] = {}
        for group, offset in placed:
            missing = [n for n in group.hf_names if n not in hf_tensors]
            if missing:
                raise MissingTensors(f"parameter group {group.index} still misses {missing[:8]}")
            for m in self._members[group.index]:
                entry = per_role.setdefault(m.role, ([], {}))
                entry[0].append((m.group, offset + m.offset))
                entry[1].update({n: hf_tensors[n] for n in m.group.hf_names})
        regions: list[SlotRegion] = []
        for role, (role_placed, tensors) in per_role.items():
            for r in self.roles[role].load_groups(role_placed, tensors, slot):
                regions.append(SlotRegion(qualified(role, r.param_name), r.offset, r.nbytes))
        return regions

    def load_group(self, group: ParameterGroup, hf_tensors: Mapping[str, "torch.Tensor"],
                          slot: "torch.Tensor", offset: int = 0) -> list[SlotRegion]:
        return self.load_groups([(group, offset)], hf_tensors, slot)

    def not_a_copy(self, group: ParameterGroup) -> str | None:
        """Why ``group`` cannot be a copy plan: some role's replica post-processes its bytes on send."""
        for m in self._members[group.index]:
            why = getattr(self.roles[m.role], "not_a_copy", None)
            reason = why(m.group) if why is not None else None
            if reason:
                return reason
        return None


def _align(n: int) -> int:
    return -(-n // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


def _join_groups(roles: Mapping[str, "ModelReplica"]) -> tuple[list[ParameterGroup], dict[int, list[_Member]]]:
    """Every role's groups, those sharing an HF input joined into one (connected components), laid
    out member after member; parameter names role-qualified."""
    members = [(role, g) for role, r in roles.items() for g in r.groups]
    parent = list(range(len(members)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_reader: dict[str, int] = {}
    for i, (_, g) in enumerate(members):
        for hf in g.hf_names:
            j = first_reader.setdefault(hf, i)
            if j != i:
                parent[find(i)] = find(j)
    components: dict[int, list[int]] = {}
    for i in range(len(members)):
        components.setdefault(find(i), []).append(i)
    groups: list[ParameterGroup] = []
    joined: dict[int, list[_Member]] = {}
    for index, component in enumerate(components.values()):
        params: list[str] = []
        hf_names: dict[str, None] = {}
        regions: list[SlotRegion] = []
        parts: list[_Member] = []
        offset = 0
        for i in component:
            role, g = members[i]
            offset = _align(offset)
            parts.append(_Member(role, g, offset))
            params += [qualified(role, p) for p in g.params]
            hf_names.update(dict.fromkeys(g.hf_names))
            regions += [SlotRegion(qualified(role, r.param_name), offset + r.offset, r.nbytes) for r in g.regions]
            offset += g.nbytes
        groups.append(ParameterGroup(index, tuple(params), tuple(hf_names), tuple(regions)))
        joined[index] = parts
    return groups, joined


def rank_replica(replicas: "ModelReplicas", config: Any, engine: EngineLayout, rank: int,
                 hf_specs: Mapping[str, TensorSpec] | None = None) -> "ModelReplica | RankRoles":
    """What a sender prepares for engine rank ``rank``: the target replica alone, or every role of
    an engine that runs a draft joined (:class:`RankRoles`)."""
    roles = roles_of(config, engine)
    if roles == ("target",):
        return replicas.get(config, engine, rank, hf_specs=hf_specs)
    return join_roles({role: replicas.get(config, engine, rank, hf_specs=hf_specs, role=role) for role in roles})


def join_roles(members: Mapping[str, "ModelReplica"]) -> RankRoles:
    """The :class:`RankRoles` of these role replicas (any engine kind's; ``"target"`` among them),
    one per set of replica objects (invariant 7): a reconnect reuses it, and what is kept per
    replica object (recorded copy plans, p2pweights.copyplans) with it."""
    with _JOINED_LOCK:
        joined = _JOINED.get(members["target"])
        if joined is None or any(joined.roles.get(r) is not m for r, m in members.items()):
            joined = _JOINED[members["target"]] = RankRoles(members)
        return joined


_JOINED: "weakref.WeakKeyDictionary[ModelReplica, RankRoles]" = weakref.WeakKeyDictionary()
_JOINED_LOCK = threading.Lock()
