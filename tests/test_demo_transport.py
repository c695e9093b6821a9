"""`p2pweights demo --transport auto`: NIXL where its native C-API sender path loads, else Mooncake."""
from __future__ import annotations

import pytest

from p2pweights.commands.demo import _default_transport, pick_transport
from p2pweights.transport import nixl_native


def test_an_explicit_transport_is_kept():
    assert pick_transport("mooncake") == ("mooncake", "")
    assert pick_transport("nixl") == ("nixl", "")


def test_the_demo_defaults_to_auto_unless_p2pw_transport_is_set(monkeypatch):
    monkeypatch.delenv("P2PW_TRANSPORT", raising=False)
    assert _default_transport() == "auto"
    monkeypatch.setenv("P2PW_TRANSPORT", "mooncake")
    assert _default_transport() == "mooncake"


def test_auto_takes_nixl_where_its_c_api_loads():
    if nixl_native.capi_library() is None:
        pytest.skip("no NIXL wheel with libnixl_capi.so installed")
    name, why = pick_transport("auto")
    assert name == "nixl" and "native C-API path loads" in why


def test_auto_falls_back_to_mooncake_when_nixl_is_set_to_its_python_api(monkeypatch):
    monkeypatch.setenv("P2PW_NIXL_API", "python")
    name, why = pick_transport("auto")
    assert name == "mooncake" and "P2PW_NIXL_API=python" in why


def test_auto_falls_back_to_mooncake_when_the_c_api_library_does_not_load(monkeypatch, tmp_path):
    broken = tmp_path / "libnixl_capi.so"
    broken.write_bytes(b"not an ELF file")  # found on disk, but dlopen refuses it
    monkeypatch.setattr(nixl_native, "capi_library", lambda: str(broken))
    name, why = pick_transport("auto")
    assert name == "mooncake" and "does not load" in why and str(broken) in why
