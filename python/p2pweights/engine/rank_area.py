"""An engine rank's side of deltas, the same in every host (our receiver's rank processes, the sglang
plugin's schedulers, the vLLM backend's workers): its area (placed and sized by
``deltas.area.open_rank_area``), where the area's records may write, and the one apply of a
session's manifests. The rank's registrations, publication and revocation are
``transport.revocation.RevocableRegions``, also one for every host."""
from __future__ import annotations

from typing import Any, Iterable

from ..deltas.area import DeltaArea, parse_segments
from ..deltas.weight_views import device_views, host_views
from ..errors import InvalidWrite


class RankDeltas:
    """``area`` (None: the rank takes full writes) of engine ``engine``'s rank ``rank``."""

    def __init__(self, area: DeltaArea | None, rank: int, engine: str, device: str = "cpu"):
        self.area, self.rank, self.engine, self.device = area, int(rank), engine, device
        self.writable: list[tuple[int, int]] = []  # where the records may write
        self.tensors: list[Any] = []              # what index records are applied through

    def cover(self, regions: Iterable[tuple[int, int]], named: Iterable[tuple[str, Any]] | None = None,
              tensors: list[Any] | None = None) -> None:
        """The records may write ``regions`` from now on: through ``tensors`` (given: the regions' own
        storage), else host views of them, or on a GPU the parameters ``named`` (deltas/weight_views.py)."""
        if self.area is None:
            return
        regions = [(int(a), int(n)) for a, n in regions]
        if tensors is not None:
            self.writable, self.tensors = regions, list(tensors)
        elif self.area.device == "cpu":
            self.writable, self.tensors = host_views(regions)
        elif named is not None:
            self.writable, self.tensors = device_views(named)
        else:
            raise ValueError("a GPU delta area needs the tensors its records are applied through")

    def apply(self, manifests: Any) -> dict:
        """This rank's manifest of ``manifests`` (``{"<rank>": manifest or [segment, ...]}``; none:
        nothing to apply), every segment checked whole against what the area holds, then applied."""
        manifest = manifests.get(str(self.rank)) if isinstance(manifests, dict) else None
        if manifest is None:
            return {"rank": self.rank, "records": 0}
        if self.area is None:
            raise InvalidWrite(f"engine {self.engine} rank {self.rank} has no delta area (weights on {self.device})",
                               rank=self.rank)
        parsed = parse_segments(manifest, f"engine {self.engine} rank {self.rank}")
        return {"rank": self.rank, **self.area.apply(parsed, self.writable, self.tensors)}

    def close(self) -> None:
        self.tensors = []
        if self.area is not None:
            self.area.close()
