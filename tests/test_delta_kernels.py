"""The GPU delta kernels (csrc/kernels/delta_find.cu via deltas/kernels.py) against the torch path
they replace (deltas/index_records.py): the same positions, values and count, the bases moved on
byte for byte, the same payload checksum. The compare needs a CUDA device and a native module built
with nvcc (the H200 runs: benchmarks/gpu/run_on_device.sh tests); the argument checks run anywhere."""
from __future__ import annotations

import pytest
import torch

from p2pweights import _native
from p2pweights.deltas import index_records as ir
from p2pweights.deltas import kernels

GPU = torch.cuda.is_available() and _native.delta_kernels_embedded()
needs_gpu = pytest.mark.skipif(not GPU, reason="needs a CUDA device and the native module's delta kernels")


def test_a_unit_the_kernels_do_not_take_is_refused_before_any_launch():
    code, message = _native.delta_find_count(8, 1, 3, 8, 8, 1, 0)
    assert code == int(_native.Code.INVALID_ARGUMENT) and "unit" in message


def test_cpu_tensors_never_take_the_kernels():
    t = torch.zeros(64, dtype=torch.uint8)
    assert not kernels.usable(t, t)


def _pair(words: list[int], fraction: float, unit: int, seed: int):
    """A slot and a base holding params of ``words`` 8-byte words each at 256-byte boundaries, the
    base differing in about ``fraction`` of the unit-sized elements; the params' (slot, base, bytes)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    params, at_slot, at_base = [], 512, 256  # offsets differ: the slot and base rows are not the same
    for w in words:
        params.append((at_slot, at_base, 8 * w))
        at_slot += -(-8 * w // 256) * 256 + 256
        at_base += -(-8 * w // 256) * 256
    slot = torch.randint(0, 256, (at_slot,), dtype=torch.uint8, device="cuda", generator=g)
    base = torch.zeros(at_base, dtype=torch.uint8, device="cuda")
    dt = ir._dtype(unit)
    for so, bo, n in params:
        base[bo:bo + n] = slot[so:so + n]
        elems = base[bo:bo + n].view(dt)
        flip = torch.rand(elems.numel(), device="cuda", generator=g) < fraction
        elems[flip] = elems[flip] ^ 1  # changes the element (the low bit of its first byte)
    return slot, base, params


def _find(slot, base, params, unit, limit, use_kernels, into=None):
    kernels.ENABLED = use_kernels
    try:
        b = base.clone()
        found = ir.find_changes(slot, b, params, unit, limit, into)
        torch.cuda.synchronize()
        return found, b
    finally:
        kernels.ENABLED = True


@needs_gpu
@pytest.mark.parametrize("unit", [1, 2, 4])
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.01, 0.3, 1.0])
def test_the_kernels_find_what_torch_finds(unit, fraction):
    words = [1, 31, 4095, 4096, 4097, 50_000, 3]  # partial, whole and several blocks per param
    slot, base, params = _pair(words, fraction, unit, seed=int(fraction * 1000) + unit)
    got, got_base = _find(slot, base, params, unit, None, True)
    want, want_base = _find(slot, base, params, unit, None, False)
    assert got.count == want.count and got.elements == want.elements
    assert torch.equal(got.positions, want.positions)
    assert torch.equal(got.values, want.values)
    for so, bo, n in params:  # the bases moved on: every byte the slot's
        assert torch.equal(got_base[bo:bo + n], slot[so:so + n])
    assert torch.equal(got_base, want_base)
    if fraction == 0.0:
        assert got.count == 0
    elif fraction >= 0.3:
        assert got.count > 0


@needs_gpu
def test_more_changes_than_the_limit_copy_the_bases_whole():
    slot, base, params = _pair([5000, 7000], 0.2, 2, seed=3)
    got, got_base = _find(slot, base, params, 2, 10, True)
    assert got.positions is None and got.count > 10
    for so, bo, n in params:
        assert torch.equal(got_base[bo:bo + n], slot[so:so + n])


@needs_gpu
@pytest.mark.parametrize("words", [1, 255, 256, 257, 300_000])
def test_the_checksum_kernel_equals_the_torch_expression(words):
    payload = torch.randint(0, 256, (8 * words,), dtype=torch.uint8, device="cuda")
    got = int(kernels.checksum(payload))
    kernels.ENABLED = False
    try:
        want = int(ir.checksum(payload))
    finally:
        kernels.ENABLED = True
    assert got == want
    payload[8 * (words // 2)] ^= 1
    assert int(kernels.checksum(payload)) != got


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if GPU else []))
def test_bases_moved_on_in_full_take_every_byte_of_their_params_and_no_other(device):
    slot = torch.randint(0, 256, (4096,), dtype=torch.uint8, device=device)
    base = torch.zeros(4096, dtype=torch.uint8, device=device)
    params = [(0, 1024, 256), (512, 0, 8), (2048, 2048, 1000), (3500, 3200, 0)]
    kernels.copy_spans(slot, base, params)
    want = torch.zeros_like(base)
    for so, bo, n in params:
        want[bo:bo + n] = slot[so:so + n]
    assert torch.equal(base, want)


@needs_gpu
@pytest.mark.parametrize("unit", [1, 2, 4])
def test_a_payload_gathered_in_place_is_the_payload_torch_writes(unit):
    slot, base, params = _pair([3, 4097, 700], 0.03, unit, seed=5 + unit)
    placed = []

    def into(count):
        out = torch.full((ir.payload_bytes(count, unit) + 8,), 0xAB, dtype=torch.uint8, device="cuda")[8:]
        placed.append(out)  # stale bytes in the padding: the gather must zero it
        return out

    got, _ = _find(slot, base, params, unit, None, True, into=into)
    want, _ = _find(slot, base, params, unit, None, False)
    assert placed and got.count == want.count > 0
    check = int(ir.write_payload(got, placed[0]))
    out = torch.empty(ir.payload_bytes(want.count, unit), dtype=torch.uint8, device="cuda")
    assert check == int(ir.write_payload(want, out))
    assert torch.equal(placed[0], out)
