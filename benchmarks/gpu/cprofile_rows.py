"""A cProfile run as table rows: the ``top`` functions by own time (bench_gpu.py's ``profile`` and
``update_profile`` sections, profile_gpu_delta.py's host rows)."""
from __future__ import annotations

import os
import pstats


def top_functions(prof, top: int) -> list[dict]:
    """A cProfile run's ``top`` functions by own time, as rows."""
    rows = [{"function": f"{os.path.basename(f)}:{line}:{name}", "calls": nc, "tottime": tt, "cumtime": ct}
            for (f, line, name), (cc, nc, tt, ct, _) in pstats.Stats(prof).stats.items()]
    rows.sort(key=lambda r: -r["tottime"])
    return rows[:top]
