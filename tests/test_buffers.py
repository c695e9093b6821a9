"""Transfer buffers: alignment, slot sizing, zero-copy views, pinning fallback; settings."""
from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from p2pweights import _native
from p2pweights.errors import Closed, InvalidWrite
from p2pweights.sender.buffers import TransferBuffers, slot_size
from p2pweights.settings import parse_size, settings

ALIGN = _native.TransferBuffer.alignment


def test_slots_are_aligned_and_sized_up_to_the_alignment():
    with TransferBuffers(ALIGN + 1, 3, pin="none") as b:
        assert b.slot_bytes == 2 * ALIGN and b.num_slots == 3
        assert b.address % 4096 == 0
        assert [b.slot_address(i) - b.address for i in range(3)] == [0, 2 * ALIGN, 4 * ALIGN]


def test_slot_size_is_the_larger_of_request_and_largest_group():
    assert slot_size(64 << 20, 10) == 64 << 20
    n = slot_size(1 << 20, (100 << 20) + 1)
    assert n >= (100 << 20) + 1 and n % ALIGN == 0 and n - ((100 << 20) + 1) < ALIGN


def test_numpy_and_torch_views_share_the_slot_memory():
    with TransferBuffers(ALIGN, 2, pin="none") as b:
        a = b.slot_array(1)
        t = b.slot_tensor(1)
        a[:8] = np.arange(8)
        assert t[:8].tolist() == list(range(8))
        t[8] = 99
        assert a[8] == 99
        assert a.ctypes.data == b.slot_address(1) == t.data_ptr()


def test_pinning_falls_back_with_one_warning_not_a_crash():
    devices = _native.cuda_runtime_info()["device_count"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with TransferBuffers(ALIGN, 1, pin="none") as b:
            assert b.pin_mode == "none"  # unpinned on request: no warning
        with TransferBuffers(ALIGN, 1, pin="auto") as b:
            # 2 MiB fits the default memlock limit: pinned one way or the other, silently
            assert b.pin_mode == ("cuda_host_register" if devices else "mlock")
    assert [str(w.message) for w in caught] == []
    if not devices:
        # CUDA pinning asked for where it cannot work: unpinned memory and exactly one warning saying why.
        with pytest.warns(RuntimeWarning) as caught:
            with TransferBuffers(ALIGN, 1, pin="cuda") as b:
                assert b.pin_mode == "none"
                b.slot_array(0)[:] = 1  # and the memory works
        assert len(caught) == 1
        assert "not pinned (" in str(caught[0].message)
        assert "no CUDA runtime" in str(caught[0].message) or "has no device" in str(caught[0].message)
    with pytest.raises(InvalidWrite, match="pin must be"):
        TransferBuffers(ALIGN, 1, pin="bogus")


def test_cuda_pinning_asked_for_by_name_that_the_runtime_fails_is_a_device_error(tmp_path):
    """A runtime with a device whose cudaHostRegister fails (tests/fake_cuda/fake_runtime.cpp): pin="cuda"
    raises DeviceError (the device failed, not a transport); pin="auto" still falls back to mlock."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler to build the stand-in runtime")
    lib = tmp_path / "libfake_cudart.so"
    subprocess.run([cxx, "-shared", "-fPIC", os.path.join(os.path.dirname(__file__), "fake_cuda", "fake_runtime.cpp"),
                    "-o", str(lib)], check=True)
    code = textwrap.dedent("""
        import json, warnings
        from p2pweights import _native
        from p2pweights.errors import DeviceError
        out = {"runtime": _native.cuda_runtime_info()}
        try:
            _native.TransferBuffer.allocate(1 << 20, 1, "cuda")
        except DeviceError as e:
            out["cuda"] = str(e)
        b = _native.TransferBuffer.allocate(1 << 20, 1, "auto")
        out["auto"] = [b.pin_mode, b.pin_warning]
        b.close()
        print(json.dumps(out))
    """)
    env = {**os.environ, "P2PW_CUDA_RUNTIME": str(lib)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["runtime"]["device_count"] == 1 and out["runtime"]["library"] == str(lib), out
    assert "cudaHostRegister of 2097152 bytes failed: out of memory" in out["cuda"], out
    assert out["auto"] == ["mlock", ""], out


def test_closing_under_a_live_slot_tensor_defers_the_free_until_the_view_dies():
    b = TransferBuffers(ALIGN, 2, pin="none")
    t = b.slot_tensor(1)
    a = b.slot_array(0)[:16]  # a slice of a view holds the memory too
    b.close()
    assert b.native.closed and not b.native.released
    with pytest.raises(Closed):
        b.slot_tensor(0)  # no new views of a closed buffer
    t[:4] = 9  # still mapped: no use after free
    assert t[:4].tolist() == [9] * 4
    del t
    gc.collect()
    assert not b.native.released  # `a` is still alive
    a[:] = 1
    del a
    gc.collect()
    assert b.native.released and b.native.users == 0


@pytest.mark.parametrize("slot_bytes, num_slots", [
    ((1 << 62) + ALIGN, 4),      # wrapped to 8 MiB: the allocation succeeded and a view's write segfaulted
    ((1 << 64) - 1, 1),          # the rounding up to the alignment itself wraps to 0
    (1 << 63, 2),
])
def test_a_buffer_whose_size_does_not_fit_in_64_bits_is_refused_never_wrapped(slot_bytes, num_slots):
    with pytest.raises(InvalidWrite, match="do not fit in a 64-bit size"):
        _native.TransferBuffer.allocate(slot_bytes, num_slots, "none")
    # wrapped memory too: slots that would run past 2^64 (or whose total wraps) are refused
    with pytest.raises(InvalidWrite, match="past the end of the address space"):
        _native.TransferBuffer.wrap((1 << 64) - ALIGN, ALIGN, 2, "cpu")
    with pytest.raises(InvalidWrite, match="past the end of the address space"):
        _native.TransferBuffer.wrap(1 << 40, slot_bytes, num_slots, "cpu")


def test_closed_buffer_refuses_views():
    b = TransferBuffers(ALIGN, 1, pin="none")
    b.close()
    b.close()
    with pytest.raises(Exception, match="closed"):
        b.slot_array(0)


def test_settings_take_keywords_over_env_over_defaults(monkeypatch):
    assert settings().buffer_size == 512 << 20 and settings().num_slots is None and settings().transfer_timeout == 30
    monkeypatch.setenv("P2PW_BUFFER_SIZE", "64MiB")
    monkeypatch.setenv("P2PW_TRANSFER_TIMEOUT", "5")
    assert settings().buffer_size == 64 << 20 and settings().transfer_timeout == 5
    assert settings(buffer_size=1 << 20).buffer_size == 1 << 20
    monkeypatch.setenv("SGLANG_REMOTE_INSTANCE_NIXL_BACKEND", "LIBFABRIC")
    assert settings().nixl_backend == "LIBFABRIC"
    monkeypatch.setenv("P2PW_NIXL_BACKEND", "UCX")
    assert settings().nixl_backend == "UCX"
    monkeypatch.setenv("P2PW_TRANSPORT", "carrier-pigeon")
    with pytest.raises(ValueError, match="P2PW_TRANSPORT"):
        settings()


def test_unset_slot_count_is_two_host_slots_and_four_gpu_slots(monkeypatch):
    """P2PW_NUM_SLOTS unset: host slots double-buffer, GPU slots take four (a GPU refills a slot faster
    than its writes are seen complete: benchmarks/RESULTS.md, issue 36 item 6); a set count is kept."""
    from p2pweights.sender.buffers import slot_count

    assert slot_count(settings()) == slot_count(settings(buffer_device="cpu")) == 2
    assert slot_count(settings(buffer_device="cuda")) == slot_count(settings(buffer_device="cuda:1")) == 4
    assert slot_count(settings(num_slots=3, buffer_device="cuda")) == 3
    monkeypatch.setenv("P2PW_NUM_SLOTS", "1")
    assert slot_count(settings(buffer_device="cuda:0")) == slot_count(settings()) == 1


def test_sizes_parse_with_units():
    assert parse_size("512MiB") == 512 << 20 and parse_size("1GB") == 10**9 and parse_size(7) == 7
    with pytest.raises(ValueError, match="64MiB"):
        parse_size("lots")


_FAKE_CUDART = "int cudaGetDeviceCount(int* n) { *n = 0; return 0; }\n" \
    "int cudaHostRegister(void* p, unsigned long n, unsigned f) { return 1; }\n" \
    "int cudaHostUnregister(void* p) { return 0; }\n"

_PROBE = textwrap.dedent("""
    import ctypes, json, os, sys
    if sys.argv[1]:
        ctypes.CDLL(sys.argv[1], mode=os.RTLD_NOW | os.RTLD_GLOBAL)  # what torch's CUDA build does
    os.environ["P2PW_CUDA_RUNTIME"] = sys.argv[2]
    from p2pweights import _native
    info = _native.cuda_runtime_info()
    mapped = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libcudart" in line})
    print(json.dumps({"library": info["library"], "mapped": mapped}))
""")


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build a stand-in libcudart")
def test_the_cuda_runtime_is_loaded_once_even_when_named_by_another_path(tmp_path):
    """A runtime already in the process (by soname) is used rather than a second copy by path."""
    src = tmp_path / "cudart.c"
    src.write_text(_FAKE_CUDART)
    copies = []
    for d in ("torch_lib", "cuda_home"):
        (tmp_path / d).mkdir()
        lib = tmp_path / d / "libcudart.so.12"
        subprocess.run(["cc", "-shared", "-fPIC", "-Wl,-soname,libcudart.so.12", "-o", str(lib), str(src)], check=True)
        copies.append(str(lib))
    torch_copy, named_copy = copies

    def probe(preloaded: str) -> dict:
        out = subprocess.run([sys.executable, "-c", _PROBE, preloaded, named_copy], check=True, capture_output=True,
                             text=True, env={**os.environ, "P2PW_CUDA_RUNTIME": ""})
        return json.loads(out.stdout.strip().splitlines()[-1])

    already = probe(torch_copy)
    assert already["mapped"] == [torch_copy], already  # one runtime, the one that was there first
    assert already["library"] == "libcudart.so.12"
    fresh = probe("")
    assert fresh["mapped"] == [named_copy] and fresh["library"] == named_copy  # none loaded: the named one


def test_the_native_stub_declares_everything_the_extension_exports():
    import ast
    import pathlib

    import p2pweights

    stub = ast.parse((pathlib.Path(p2pweights.__file__).parent / "_native.pyi").read_text())
    declared: dict[str, set[str]] = {}
    for node in stub.body:
        if isinstance(node, ast.ClassDef):
            declared[node.name] = {n.name if hasattr(n, "name") else n.target.id for n in node.body
                                   if isinstance(n, (ast.FunctionDef, ast.AnnAssign))}
        elif isinstance(node, ast.FunctionDef):
            declared[node.name] = set()
        elif isinstance(node, ast.AnnAssign):
            declared[node.target.id] = set()
    exported = [n for n in dir(_native) if not n.startswith("_") or n == "__version__"]
    assert sorted(set(exported) - set(declared)) == []
    for name in exported:
        obj = getattr(_native, name)
        if isinstance(obj, type) and name != "Code":
            own = {m for m in vars(obj) if not m.startswith("_")}
            assert sorted(own - declared[name]) == [], name
