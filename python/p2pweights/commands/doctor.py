"""`p2pweights doctor`: what this machine offers p2pweights, and what is missing with the fix."""
from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import json
import sys
import warnings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _try_import(module: str) -> tuple[bool, str]:
    try:
        importlib.import_module(module)
        return True, ""
    except Exception as e:  # noqa: BLE001 - any failure to import is the finding
        return False, f"{type(e).__name__}: {e}"


def _transports() -> dict[str, dict]:
    out = {}
    ok, why = _try_import("mooncake.engine")
    out["mooncake"] = {
        "importable": ok,
        "version": _version("mooncake-transfer-engine-non-cuda") or _version("mooncake-transfer-engine")
        or _version("mooncake-transfer-engine-cuda13"),
        "error": why or None,
        "fix": None if ok else ("apt-get install libibverbs1 && pip install mooncake-transfer-engine-non-cuda "
                                "(GPU: mooncake-transfer-engine)"),
    }
    nixl_mod, nixl_why = None, ""
    for mod in ("nixl_cu12", "nixl_cu13", "nixl._api"):
        ok, why = _try_import(mod)
        if ok:
            nixl_mod = mod
            break
        nixl_why = nixl_why or why
    out["nixl"] = {
        "importable": nixl_mod is not None,
        "module": nixl_mod,
        "version": _version("nixl-cu12") or _version("nixl-cu13") or _version("nixl"),
        "error": None if nixl_mod else nixl_why,
        "fix": None if nixl_mod else "pip install --no-deps nixl-cu12 (or nixl-cu13)",
    }
    try:  # the sender's NIXL data path: native (C API, no GIL) or Python, and why
        from ..transport.nixl_native import data_path

        out["nixl"]["data_path"] = data_path()
    except Exception as e:  # noqa: BLE001 - e.g. an invalid P2PW_NIXL_API (reported with the settings)
        out["nixl"]["data_path"] = {"path": None, "library": None, "reason": str(e)}
    return out


def _default_transport() -> dict:
    """What P2PW_TRANSPORT resolves to here (``transport.resolve_transport``) and why; a sender with
    ``auto`` takes the transport its engines publish for, this when they say none."""
    from ..settings import SettingError, lookup
    from ..transport import resolve_transport

    try:
        setting, source = lookup("P2PW_TRANSPORT")
        resolved, why = resolve_transport(setting)
    except (SettingError, ValueError) as e:
        return {"setting": None, "source": None, "resolved": None, "why": str(e)}
    return {"setting": setting, "source": source, "resolved": resolved,
            "why": why or "named explicitly"}


def collect() -> dict:
    from .. import _native
    from ..settings import SettingError, describe, settings

    findings: dict = {"native": {"version": _native.__version__, "path": _native.__file__}}
    cuda = _native.cuda_runtime_info()
    findings["cuda"] = cuda
    # A small buffer tells which pinning this process gets (CUDA registration, mlock or none).
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from ..sender.buffers import TransferBuffers

        with TransferBuffers(1 << 20, 1) as b:
            findings["pinning"] = {"mode": b.pin_mode, "warning": str(caught[0].message) if caught else None}
    # every declared P2PW_ setting with its value and where it came from; invalid ones carry "error"
    findings["settings"] = describe()
    findings["settings_ok"] = not any("error" in row for row in findings["settings"])
    try:
        findings["slot_device"] = settings().buffer_device
    except SettingError:
        findings["slot_device"] = None
    findings["transports"] = _transports()
    findings["transport"] = _default_transport()
    findings["torch"] = _version("torch")
    findings["sglang"] = _sglang_version()
    return findings


def _sglang_version() -> str | None:
    """sglang's version as both sides read it (``models.sglang_version``: package metadata, else a
    source tree's ``__version__``); a source tree that fails to import is reported, not fatal."""
    from ..models.sglang_version import sglang_version

    try:
        return sglang_version()
    except Exception as e:  # noqa: BLE001 - doctor reports a broken import, it does not die of it
        return f"(import failed: {type(e).__name__}: {e})"


def run(args: argparse.Namespace) -> int:
    f = collect()
    status = 0 if f["settings_ok"] else 1  # an invalid setting fails here, not in the middle of an update
    if args.json:
        print(json.dumps(f, indent=2, default=str))
        return status
    cuda = f["cuda"]
    print(f"p2pweights native module {f['native']['version']}  ({f['native']['path']})")
    print(f"CUDA runtime   : {cuda['library'] or 'not found'}; devices: {cuda['device_count']}")
    print(f"pinning        : {f['pinning']['mode']}" + (f"  ({f['pinning']['warning']})" if f['pinning']['warning'] else ""))
    print(f"slot device    : {f['slot_device']}")
    for name, t in f["transports"].items():
        state = f"ok ({t['version']})" if t["importable"] else f"MISSING — {t['error']}; fix: {t['fix']}"
        print(f"{name:<15}: {state}")
        if "data_path" in t and t["importable"]:
            print(f"  data path    : {t['data_path']['path']} — {t['data_path']['reason']}")
    t = f["transport"]
    print(f"transport      : {t['resolved'] or 'INVALID'} (P2PW_TRANSPORT={t['setting']} [{t['source']}]: {t['why']})")
    print(f"torch          : {f['torch'] or 'MISSING (pip install torch)'}")
    print(f"sglang         : {f['sglang'] or 'MISSING (bash scripts/setup.sh installs sglang==0.5.23)'}")
    print("settings       :")
    width = max(len(row["env"]) for row in f["settings"])
    for row in f["settings"]:
        shown = "(unset)" if row["value"] in (None, "") else row["value"]
        line = f"  {row['env']:<{width}}  {shown}  [{row['source']}]"
        if "error" in row:
            line += f"  INVALID: {row['error']}"
        print(line)
    if status:
        print("doctor: some settings are invalid (see INVALID above); fix or unset them", file=sys.stderr)
    return status
