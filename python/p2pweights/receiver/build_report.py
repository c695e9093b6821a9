"""What a receiver says of its own build: the sglang version its ranks run and the GPU architecture
each rank holds its parameters on. Senders compare both with their replica environment at connect
(``replica/build_check.py``): each rank publishes ``device_arch`` and ``sglang_version`` next to its
weights table, and the engine's ``/server_info`` reports ``version`` (as sglang's does) and
``p2pw_device_archs`` (rank -> architecture, from what the ranks registered).

A rank on the CPU holds a GPU rank's layout in host memory and runs sglang's CUDA-path
post-processing without DeepGEMM: it says ``cpu``, which a sender tells apart from sglang's own CPU
engine (``device: cpu``, AMX repacking) by the ``device`` the engine reports (``cuda``). A rank on
the CPU whose layout names ``gpu_arch=sm100`` holds a Blackwell rank's post-processed layout
(``EngineRank``: sglang's UE8M0 post-processing applied) and says ``sm100``.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..models.sglang_version import sglang_version


def device_arch(device: str, layout_arch: str | None = None) -> str:
    """``cpu``; ``sm90`` for a CUDA device of compute capability 9.0; ``gfx942`` on ROCm.
    ``layout_arch``: the architecture the rank's layout names (``EngineLayout.gpu_arch``, ``sm100``):
    a rank on the CPU holds that GPU rank's post-processed layout (``EngineRank``), and says so."""
    if not str(device).startswith("cuda"):
        return layout_arch or "cpu"
    import torch

    index = torch.device(device).index or 0
    if getattr(torch.version, "hip", None):
        return str(torch.cuda.get_device_properties(index).gcnArchName).split(":", 1)[0]
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def server_identity(registered: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """The ``/server_info`` keys of the engine's build, from the ranks' registrations."""
    archs = {str(rank): str(extra["device_arch"]) for rank, extra in sorted(registered.items())
             if extra.get("device_arch")}
    versions = {str(extra["sglang_version"]) for extra in registered.values() if extra.get("sglang_version")}
    # one version for the engine, as sglang reports it; ranks that disagree are refused by the
    # sender from their publications, so report this process's own then
    version = versions.pop() if len(versions) == 1 else sglang_version()
    return {"version": version, "p2pw_device_archs": archs}
