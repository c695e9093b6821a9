"""``p2pweights plan --engine-kind vllm``: a vLLM 0.33 engine's layout (``replica.vllm_layout``) as the
cost model's engine. The cost model counts bytes per engine rank, and vLLM shards them as sglang does
for the same split:
- ``tp=T`` (EP off or on) is sglang's ``tp=T`` (``ep=T`` with EP): one TP group;
- ``tp=T,dp=D`` with expert parallelism is sglang's ``tp=T*D, dp=D, ep=T*D``: attention TP-sharded
  inside each DP rank, experts spread over all T*D ranks;
- ``dp=D`` without expert parallelism is D engines of ``tp=T`` (each DP rank holds every weight, the
  experts TP-sharded): refused here, naming the ``--engines`` that plans it.
A layout whose post-processing rewrites what the loaders wrote is refused as check-layout refuses it
(``vllm_layout.refusal``), so the plan never prices an engine the sender would refuse at connect."""
from __future__ import annotations

import re
from typing import Any, Mapping

from ..errors import P2PWeightsError
from ..models.engine_layout import EngineLayout
from ..models.shapes import PlanError
from ..planner.assign import Engine
from ..replica.vllm_layout import VllmLayout, refusal


def vllm_engines(sizes: list[int], spec: str, config: Mapping[str, Any]) -> list[Engine]:
    """One cost-model Engine per engine of ``sizes`` GPUs, each a vLLM engine of ``spec`` (``tp``
    defaults to the GPUs over ``dp``)."""
    layouts: dict[int, EngineLayout] = {}
    for gpus in sizes:
        if gpus in layouts:
            continue
        try:
            found = re.search(r"(?:^|,)\s*dp\s*=\s*(\d+)", spec)
            dp = int(found.group(1)) if found else 1
            if dp < 1 or gpus % dp:
                raise PlanError(f"--engine dp={dp}: a vLLM engine of {gpus} GPUs cannot hold {dp} DP ranks")
            layout = VllmLayout.parse(spec if "tp=" in spec else f"tp={gpus // dp},{spec}".rstrip(","),
                                      command="plan")
            if layout.world_size != gpus:
                raise PlanError(f"--engine {layout.describe()}: {layout.world_size} ranks on an engine of {gpus} GPUs "
                                f"(--engines NxG: G = tp x dp)")
            layout.check_supported()
            why = refusal(config, layout)
            if why:
                raise PlanError(f"--engine {layout.describe()}: {why}")
            layouts[gpus] = _as_cost_layout(layout, gpus)
        except PlanError:
            raise
        except P2PWeightsError as e:
            raise PlanError(f"--engine (vLLM): {e}") from None
    return [Engine(gpus=gpus, layout=layouts[gpus]) for gpus in sizes]


def _as_cost_layout(layout: VllmLayout, gpus: int) -> EngineLayout:
    if layout.dp == 1:
        return EngineLayout.from_args({"tp_size": gpus, "ep_size": layout.ep})
    if not layout.expert_parallel:
        raise PlanError(f"--engine {layout.describe()}: a vLLM engine with dp={layout.dp} and no expert "
                        f"parallelism is {layout.dp} copies of tp={layout.tp}; plan it as "
                        f"--engines {layout.dp}x{layout.tp} --engine tp={layout.tp}")
    return EngineLayout.from_args({"tp_size": gpus, "attn_dp_size": layout.dp, "ep_size": gpus})
