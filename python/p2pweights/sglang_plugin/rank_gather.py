"""The plugin's own actions on sglang's weight-checker path, answered by every TP rank: each rank's
answer all-gathered over the scheduler's TP CPU group (as sglang's checksum does, so rank 0's answer,
which reaches the launcher, holds every rank's), and one ``CheckWeightsReqOutput`` made of them.
Used by the digest (``digest.py``), the delta apply (``rank_deltas.py``) and the revocation
(``rank_epochs.py``); runs in the schedulers only."""
from __future__ import annotations

import json
from typing import Any


def every_tp_rank(manager: Any, mine: dict) -> list[dict]:
    """Every TP rank's answer, in rank order (a lone rank, or no process group: its own). A rank that
    failed still sends its error here, so no rank is left waiting in the gather."""
    import torch.distributed as dist

    group = manager.tp_cpu_group
    size = dist.get_world_size(group=group) if dist.is_initialized() else 1
    if size == 1:
        return [mine]
    answers: list[Any] = [None] * size
    dist.all_gather_object(answers, mine, group=group)
    return answers


def output_of(answers: list[dict], error_key: str, *, ranks_with_error: bool = False) -> Any:
    """sglang's ``CheckWeightsReqOutput``: failed (``{error_key: the first rank's error}``, and every
    rank's answer when ``ranks_with_error``) if any rank failed, else ``{"ranks": answers}``."""
    from sglang.srt.managers.io_struct import CheckWeightsReqOutput

    failed = next((a for a in answers if "error" in a), None)
    if failed is not None:
        message = {error_key: failed["error"], **({"ranks": answers} if ranks_with_error else {})}
        return CheckWeightsReqOutput(success=False, message=json.dumps(message))
    return CheckWeightsReqOutput(success=True, message=json.dumps({"ranks": answers}))
