"""The sglang installed in this process's environment, read once for both sides: the sender's
replicas are built by it (``replica/build_check.py`` compares it with the engine's, and the
replica cache keys on it) and a receiver's ranks report it (``receiver/build_report.py``)."""
from __future__ import annotations

import importlib.util
from functools import lru_cache


@lru_cache(maxsize=1)
def sglang_version() -> str | None:
    """sglang's version without importing sglang when its package metadata says it (sglang's
    ``__init__`` takes seconds: transformers patches, the frontend API); an sglang without metadata
    (a source tree on ``sys.path``) is imported for its ``__version__``. None when there is none."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        pass
    if importlib.util.find_spec("sglang") is None:
        return None
    import sglang

    return getattr(sglang, "__version__", None)
