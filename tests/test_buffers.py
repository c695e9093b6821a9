"""Transfer buffers: alignment, slot sizing, zero-copy views, pinning fallback; settings."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from p2pweights import _native
from p2pweights.sender.buffers import TransferBuffers, slot_size
from p2pweights.settings import parse_size, settings
from p2pweights.errors import InvalidWrite

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
    with TransferBuffers(ALIGN, 1, pin="auto") as b:
        assert b.pin_mode in ("cuda_host_register", "mlock", "none")
    with pytest.raises(InvalidWrite, match="pin must be"):
        TransferBuffers(ALIGN, 1, pin="bogus")


def test_closed_buffer_refuses_views():
    b = TransferBuffers(ALIGN, 1, pin="none")
    b.close()
    b.close()
    with pytest.raises(Exception, match="closed"):
        b.slot_array(0)


def test_settings_take_keywords_over_env_over_defaults(monkeypatch):
    assert settings().buffer_size == 512 << 20 and settings().num_slots == 2 and settings().transfer_timeout == 30
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


def test_sizes_parse_with_units():
    assert parse_size("512MiB") == 512 << 20 and parse_size("1GB") == 10**9 and parse_size(7) == 7
    with pytest.raises(ValueError, match="64MiB"):
        parse_size("lots")
