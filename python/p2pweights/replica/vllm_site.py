"""Where a vLLM command finds vLLM when this Python cannot import it.

scripts/setup.sh installs vLLM 0.33 apart from sglang's packages, in ``.vllm_site`` at the root of
the checkout (``pip --target``; docs/vllm.md, "Installing vLLM beside sglang"), so a plain
``import vllm`` fails. Every command that imports vLLM (``check-layout --engine-kind vllm``, ``demo
--engine-kind vllm``) calls :func:`ensure_vllm` first, before anything imports vLLM; nothing here runs
at import time. It looks, in order, in:

1. the folder the setting ``P2PW_VLLM_SITE`` names (when set, the only place: a folder without vLLM
   is refused naming the setting, rather than silently replaced by another install);
2. ``.vllm_site`` in the current directory and each of its parents;
3. ``.vllm_site`` beside the source checkout this package runs from.

The folder found goes where ``PYTHONPATH=.vllm_site`` put it before: in ``sys.path`` after
``PYTHONPATH``'s entries and the stdlib but ahead of site-packages (vLLM 0.33 needs the folder's
openai 2.25, which sglang's pin keeps at an older one in site-packages: with the folder last, vLLM's
config fails to import), and at the end of ``PYTHONPATH``, so the processes a command starts (vLLM
workers, senders, reference loads) import vLLM the same way.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
import sysconfig
from pathlib import Path

from ..errors import UnsupportedLayout
from ..settings import value

SITE_NAME = ".vllm_site"
SETTING = "P2PW_VLLM_SITE"
FIX = f"run scripts/setup.sh (it installs vLLM 0.33 into {SITE_NAME}), or set {SETTING} to a folder holding vllm/"


def has_vllm(folder: Path) -> bool:
    return (folder / "vllm" / "__init__.py").is_file()


def _checkout_site() -> Path | None:
    """``.vllm_site`` beside the source checkout (``<root>/python/p2pweights``), None when this
    package is not run from one."""
    root = Path(__file__).resolve().parents[3]  # <root>/python/p2pweights/replica/vllm_site.py
    return root / SITE_NAME if (root / "python" / "p2pweights").is_dir() else None


def candidates() -> list[Path]:
    """The folders :func:`ensure_vllm` tries when ``P2PW_VLLM_SITE`` is unset, in order."""
    here = Path.cwd().resolve()
    found = [folder / SITE_NAME for folder in (here, *here.parents)]
    checkout = _checkout_site()
    if checkout is not None and checkout not in found:
        found.append(checkout)
    return found


def site_version(folder: Path) -> str:
    """The vLLM version a folder holds, read without importing it: its dist-info, else vllm/_version.py."""
    for info in sorted(folder.glob("vllm-*.dist-info")):
        m = re.fullmatch(r"vllm-(.+)\.dist-info", info.name)
        if m:
            return m.group(1)
    try:
        text = (folder / "vllm" / "_version.py").read_text()
    except OSError:
        return "(version unknown)"
    m = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", text)
    return m.group(1) if m else "(version unknown)"


def _site_index() -> int:
    """Where ``PYTHONPATH=folder`` would have put a folder in ``sys.path``: before this Python's first
    site-packages entry (after the script's folder, PYTHONPATH's entries and the stdlib), else last."""
    site_dirs = {os.path.realpath(p) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    for i, entry in enumerate(sys.path):
        if entry and os.path.realpath(entry) in site_dirs:
            return i
    return len(sys.path)


def _use(folder: Path) -> None:
    path = str(folder)
    if path not in sys.path:
        # ahead of site-packages: vLLM needs the folder's openai, which sglang's pin keeps older there
        sys.path.insert(_site_index(), path)
    importlib.invalidate_caches()
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if path not in entries:
        os.environ["PYTHONPATH"] = os.pathsep.join([*entries, path])  # the command's child processes


def ensure_vllm(command: str) -> str | None:
    """Make vLLM importable for ``command`` (e.g. ``"check-layout --engine-kind vllm"``). Returns None
    when this Python imports vLLM already (nothing done), else the folder it was found in, after one
    line on stderr saying so. Raises :class:`UnsupportedLayout` (one line, exit code 2) naming where
    it looked and the fix when no folder holds vLLM."""
    if importlib.util.find_spec("vllm") is not None:
        return None
    named = value(SETTING)
    if named:
        folder = Path(named).expanduser().resolve()
        if not has_vllm(folder):
            raise UnsupportedLayout(f"{command}: vLLM is not importable in this Python, and {SETTING}={named} "
                                    f"holds no vllm/__init__.py; {FIX}")
    else:
        tried = candidates()
        folder = next((f for f in tried if has_vllm(f)), None)
        if folder is None:
            where = f"{SITE_NAME} in {Path.cwd().resolve()} and its parents"
            if _checkout_site() is not None:
                where += f", {_checkout_site()}"
            raise UnsupportedLayout(f"{command}: vLLM is not importable in this Python and no {SITE_NAME} holds "
                                    f"it (looked in {where}; {SETTING} is unset); {FIX}")
    _use(folder)
    print(f"p2pweights: vLLM is not importable in this Python; using vLLM {site_version(folder)} from {folder} "
          f"(scripts/setup.sh installs it there; {SETTING} names another)", file=sys.stderr, flush=True)
    return str(folder)
