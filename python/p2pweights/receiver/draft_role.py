"""The draft role of one engine rank of the test/demo engines (receiver/rank.py), as sglang runs it.

An engine whose layout runs a speculative draft (``speculative_algorithm=NEXTN`` / ``EAGLE`` on a
model with an MTP layer) builds, next to the target, sglang's draft class on every rank
(replica/draft_model.py), with its own parameters in a region of their own, registered with the
rank's transport endpoint. Then, as sglang's EAGLE worker (``init_lm_head``), the draft's
embedding and LM head become the target's tensors: they are published once, as the target's.

The rank publishes the draft's own parameters in the same weights table as the target's, with the
role prefix ``draft.`` (sglang's own spelling for draft roles in its checksums); the update
session (begin, end), the equality check, the checksum, the digest and ``get_weights_by_name`` cover
both roles. docs/protocol.md ("Roles") describes the table.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..control.weights_digest import parameter_digests
from ..errors import UnknownParameter
from ..models.checkpoint import changed_version
from ..replica import sglang_env
from ..replica.draft_model import build_role_model, shared_with_target, target_embed_and_head, tie_to_target
from ..replica.reference import compare_models, named_state
from ..replica.role_check import reference_draft
from ..replica.roles import roles_of
from .region import WeightRegion, place_parameters

if TYPE_CHECKING:
    import torch

PREFIX = "draft."


class DraftRole:
    """sglang's draft model of one engine rank, placed and tied to the target model."""

    def __init__(self, config: str, engine: Any, rank: int, target: "torch.nn.Module", device: str = "cpu"):
        self.config, self.engine, self.rank, self.device = config, engine, int(rank), device
        model = build_role_model(config, engine, rank, "draft")  # the shared tensors untied: not placed
        self.shared = shared_with_target(model)
        self.region: WeightRegion = place_parameters(model, device=device)
        tie_to_target(model, *target_embed_and_head(target))  # sglang's init_lm_head: the target's tensors
        self.model = model
        self._reference: "torch.nn.Module | None" = None
        self._reference_seed: tuple | None = None  # (hf_seed, changed version) it was loaded from

    # -- what is published -------------------------------------------------------------------------
    def own_parameters(self) -> list[tuple[str, "torch.nn.Parameter"]]:
        """(name, parameter) of the draft's own parameters (not the target's shared ones)."""
        return [(n, p) for n, p in self.model.named_parameters() if n not in self.shared]

    def published(self) -> list[tuple[str, "torch.Tensor"]]:
        """The draft's entries of the rank's weights table: role-prefixed names."""
        return [(PREFIX + n, p) for n, p in self.own_parameters()]

    # -- the update session (begin, end: the rank's UpdateHooks run sglang's hooks on this model too) ----
    def load_weights(self, weights: Sequence[tuple[str, "torch.Tensor"]]) -> None:
        """sglang's broadcast path: the draft runner loads what the target received (it keeps the MTP
        layer's tensors and skips the rest)."""
        with sglang_env.activate(self.model):
            self.model.load_weights(list(weights))

    # -- checks --------------------------------------------------------------------------------------
    def compare(self, target_reference: "torch.nn.Module", hf_seed: int, skip: Sequence[str] = (), *,
                changed: tuple[float, int] | None = None) -> Any:
        """The draft against sglang's draft loaded from the same seeded checkpoint (``changed``: that
        version of its changed family) and post-processed (tied to the target's reference, as the
        live draft is tied to the live target)."""
        loaded_from = (int(hf_seed), changed_version(changed))
        if self._reference is None or self._reference_seed != loaded_from:
            self._reference_seed = None
            self._reference = reference_draft(self.config, self.engine, self.rank, seed=int(hf_seed), post_process=True,
                                              target=target_reference, model=self._reference, changed=loaded_from[1])
            self._reference_seed = loaded_from
        # the shared embedding and head are the target's tensors: compared as the target's
        own_skip = [s[len(PREFIX):] for s in skip if s.startswith(PREFIX)]
        result = compare_models(self.model, self._reference, rank=self.rank, seed=int(hf_seed),
                                skip=[*own_skip, *self.shared])
        for m in result.mismatches:
            m.name = PREFIX + m.name
        return result

    def compare_into(self, result: Any, target_reference: "torch.nn.Module", hf_seed: int,
                     skip: Sequence[str] = (), *, changed: tuple[float, int] | None = None) -> Any:
        """Add the draft's comparison to the target's ``RankComparison`` (one answer per rank)."""
        draft = self.compare(target_reference, hf_seed, skip, changed=changed)
        result.compared += draft.compared
        result.bytes += draft.bytes
        result.mismatches += draft.mismatches
        result.seconds += draft.seconds
        return result

    def named_state(self) -> dict[str, "torch.Tensor"]:
        """Every tensor of the draft but the shared ones, role-prefixed (checksums)."""
        return {PREFIX + n: t for n, t in named_state(self.model).items() if n not in self.shared}

    def digest(self, names: Sequence[str], engine: str) -> dict[str, str]:
        """Digests of the draft's parameters named ``draft.<name>``."""
        own = {n for n, _ in self.own_parameters()}
        missing = [n for n in names if n[len(PREFIX):] not in own]
        if missing:
            raise UnknownParameter(f"engine {engine} rank {self.rank} holds no draft parameter {missing[0]!r} to digest "
                                   f"({len(missing)} unknown)", engine=engine or None, rank=self.rank,
                                   parameter=missing[0])
        got = parameter_digests(self.model, [n[len(PREFIX):] for n in names], engine=engine, rank=self.rank)
        return {PREFIX + n: d for n, d in got.items()}

    def weights_by_name(self, name: str, truncate_size: int = 100) -> Any:
        params = dict(self.model.named_parameters())
        own = name[len(PREFIX):]
        if own not in params:
            return None
        return params[own].detach()[:truncate_size].float().tolist()


def draft_role(config: str, engine: Any, rank: int, target: "torch.nn.Module", device: str = "cpu") -> DraftRole | None:
    """The rank's draft role when its layout runs one (replica/roles.py decides; a draft the replica
    cannot build raises UnsupportedLayout with the reason), else None."""
    if "draft" not in roles_of(config, engine):
        return None
    return DraftRole(config, engine, rank, target, device)


def split_names(names: Sequence[str]) -> tuple[list[str], list[str]]:
    """(target names, draft names) of a list of published names."""
    target = [n for n in names if not n.startswith(PREFIX)]
    return target, [n for n in names if n.startswith(PREFIX)]
