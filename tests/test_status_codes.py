"""Native status codes are typed once, in csrc/status.h: the Python edge reads them from the enum the
bindings make of it (``_native.Code``), and errors.py maps each error code to one exception class."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from p2pweights import _native, errors

ROOT = Path(__file__).resolve().parents[1]


def _snake(name: str) -> str:  # kOutOfRegion -> OUT_OF_REGION
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name[1:]).upper()


def test_the_bindings_enum_is_status_h_and_the_stub_says_the_same():
    body = re.search(r"enum class Code : int \{(.*?)\};", (ROOT / "csrc" / "status.h").read_text(), re.S).group(1)
    in_header = {_snake(k): int(v) for k, v in re.findall(r"(k\w+)\s*=\s*(-?\d+)", body)}
    assert {name: int(member) for name, member in _native.Code.__members__.items()} == in_header
    stub = (ROOT / "python" / "p2pweights" / "_native.pyi").read_text()
    stub_body = re.search(r"class Code\(enum.IntEnum\):\n((?:    .*\n)+)", stub).group(1)
    assert {k: int(v) for k, v in re.findall(r"(\w+) = (-?\d+)", stub_body)} == in_header


def test_every_native_error_code_maps_to_its_own_class_carrying_the_same_integer():
    members = _native.Code.__members__
    assert {n for n, m in members.items() if int(m) >= 0} == {"OK", "IN_PROGRESS"}  # the two non-errors
    assert set(errors.CLASS_OF_CODE) == {n for n, m in members.items() if int(m) < 0}
    assert len(set(errors.CLASS_OF_CODE.values())) == len(errors.CLASS_OF_CODE)  # one class per meaning
    for name, member in members.items():
        assert errors.code_of(name) == int(member)
        if int(member) >= 0:
            continue
        cls = errors.CLASS_OF_CODE[name]
        assert cls.p2pw_code == int(member) and errors.error_class(int(member)) is cls
        with pytest.raises(cls, match="why") as info:
            errors.raise_for_status(int(member), "why")
        assert type(info.value) is cls


def test_a_cuda_driver_failure_is_a_device_error_not_a_transport_error():
    assert not issubclass(errors.DeviceError, errors.TransportError)
    with pytest.raises(errors.DeviceError):
        errors.raise_for_status(errors.code_of("DEVICE_ERROR"), "cuLaunchKernel failed")


def test_the_transports_report_codes_read_from_the_enum():
    from p2pweights.transport import mooncake, nixl

    for module in (mooncake, nixl):
        assert (module.IN_PROGRESS, module.DONE) == (int(_native.Code.IN_PROGRESS), int(_native.Code.OK))
        assert module.REMOTE_DISCONNECTED == int(_native.Code.REMOTE_DISCONNECTED)
        assert module.TRANSPORT_ERROR == int(_native.Code.TRANSPORT_ERROR)
        assert type(module.TRANSPORT_ERROR) is int  # PyTransport reads a plain int from poll
    assert mooncake.TIMEOUT == int(_native.Code.TIMEOUT)
