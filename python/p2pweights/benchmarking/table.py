"""One result table for every benchmark (nccl-tests style) and the same rows as JSON."""
from __future__ import annotations

import json
import platform
import sys
from typing import Any, Sequence


def machine() -> str:
    import os

    return (f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}")


def format_table(columns: Sequence[tuple[str, str, str]], rows: Sequence[dict[str, Any]]) -> str:
    """columns: (key, header, format spec) — e.g. ("gbps", "GB/s", ".2f")."""
    cells = [[format(r[k], spec) if spec else str(r[k]) for k, _, spec in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, (_, h, _) in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    out = [line([h for _, h, _ in columns]), line(["-" * w for w in widths])]
    out += [line(c) for c in cells]
    return "\n".join(out)


def emit(title: str, columns, rows, *, as_json: bool, footer: str = "", extra: dict | None = None) -> None:
    """Prints the table (or JSON: the list of rows, or {"rows": ..., **extra} when extra is given)."""
    if as_json:
        payload: Any = rows if extra is None else {"rows": rows, **extra}
        json.dump(payload, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return
    print(f"# {title}")
    print(f"# machine: {machine()}")
    print(format_table(columns, rows))
    if footer:
        print(footer)
