"""What a real sglang server holds, read with sglang's own ``/weights_checker`` (action ``checksum``),
against what it should hold: the bytes sglang's own ``load_weights`` makes of the same HF tensors.

sglang 0.5.23's checksum of a CPU rank's parameter is SHA-256 of its bytes, the first 8 bytes in hex
(``sglang.srt.managers.mm_utils.tensor_hash``; a CUDA rank hashes with a Triton kernel instead, so
this module checks CPU servers only), keyed by sglang's parameter names, fused ones included
(``qkv_proj``, ``gate_up_proj``). The expected value is computed here independently, with
:func:`tensor_checksum`, over a reference rank built by sglang's own loader and post-processing
(``replica.reference``). ``/get_weights_by_name`` cannot serve instead: ``Qwen3ForCausalLM`` has no
``get_weights_by_name``, and sglang answers 400.

    expected = ExpectedChecksums(model_dir, EngineLayout.parse("tp=2"))
    equal, why = check_engine(SglangEngine(url), expected.of(seed=3))

Used by ``p2pweights demo --engine-kind sglang`` and the tests of real servers.
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Mapping

from ..control import SglangEngine
from ..errors import EngineError
from ..models.engine_layout import EngineLayout
from ..replica import sglang_env
from ..replica.reference import reference_model

if TYPE_CHECKING:
    import torch

# names of differing parameters a message lists before it only counts them
_LISTED = 3

RankChecksums = Mapping[int, Mapping[str, str]]  # engine tp rank -> parameter name -> checksum


def tensor_checksum(t: "torch.Tensor") -> str:
    """What sglang's checksum says of a CPU tensor: SHA-256 of its bytes, the first 8 bytes in hex.
    In logical order, as sglang's ``tensor_hash`` takes them (``.contiguous()``), also for a tensor
    laid out otherwise in memory (Blackwell's MN-major packed UE8M0 scales): this is sglang's
    checksum, compared with sglang's own. What ``update(verify=True)`` compares is another digest,
    of the bytes as they lie in memory (``control/weights_digest.py``: what a sender writes)."""
    import torch

    return hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()[:16]


class ExpectedChecksums:
    """Each tp rank's parameter checksums after sglang's own loader took a checkpoint version and its
    update session's post-processing ran. One reference model per rank is built on first use and
    reloaded for every later version (a rank of a 0.6B model is built once, not per step)."""

    def __init__(self, model: Any, layout: EngineLayout):
        self.model = model
        self.layout = layout
        self._references: dict[int, Any] = {}

    def prepare(self) -> None:
        """Build every rank's reference now (sglang's import and the rank's model: tens of seconds for a
        0.6B model on a loaded host), so that :meth:`of` only loads; the demo runs it on a thread while
        the servers start."""
        for rank in range(self.layout.tp_size):
            if rank not in self._references:  # reference_model's own build, without a load
                self._references[rank] = sglang_env.materialize(
                    sglang_env.build_model(self.model, self.layout, rank, device="meta"), "cpu")

    def of(self, seed: int, changed: tuple[float, int] | None = None) -> dict[int, dict[str, str]]:
        """``random_checkpoint(.., seed, changed=changed)`` as each rank holds it."""
        out = {}
        for rank in range(self.layout.tp_size):
            ref = reference_model(self.model, self.layout, rank, seed=int(seed), post_process=True,
                                  model=self._references.get(rank), changed=changed)
            self._references[rank] = ref
            out[rank] = {name: tensor_checksum(param) for name, param in ref.named_parameters()}
        return out


def engine_checksums(engine: SglangEngine) -> dict[int, dict[str, str]]:
    """sglang's own checksums of every rank of ``engine``, by tp rank."""
    answer = engine.weights_checker(action="checksum")
    if answer.get("success") is not True or not isinstance(answer.get("ranks"), list):
        raise EngineError(f"engine {engine.name}: /weights_checker checksum failed: {str(answer)[:500]}",
                          engine=engine.name)
    # parallelism_info: one entry per role (target, drafts), all of one tp rank
    return {int(r["parallelism_info"][0]["tp_rank"]): dict(r["checksums"]) for r in answer["ranks"]}


def differences(got: RankChecksums, want: RankChecksums) -> list[str]:
    """One line per rank that does not hold what it should (empty: every byte equal)."""
    lines = []
    for rank in sorted(set(got) | set(want)):
        if rank not in got or rank not in want:
            lines.append(f"rank {rank}: " + ("not reported by the engine" if rank not in got else "not expected"))
            continue
        g, w = got[rank], want[rank]
        missing, extra = sorted(set(w) - set(g)), sorted(set(g) - set(w))
        differ = sorted(n for n in set(g) & set(w) if g[n] != w[n])
        parts = [f"{len(names)} {what}: {', '.join(names[:_LISTED])}{', ...' if len(names) > _LISTED else ''}"
                 for what, names in (("differ", differ), ("missing", missing), ("unexpected", extra)) if names]
        if parts:
            lines.append(f"rank {rank}: {len(w)} parameters, " + "; ".join(parts))
    return lines


def check_engine(engine: SglangEngine, want: RankChecksums) -> tuple[bool, str]:
    """(equal, why not): every rank's checksums of ``engine`` against ``want``."""
    bad = differences(engine_checksums(engine), want)
    return not bad, "; ".join(f"{engine.name} {line}" for line in bad)
