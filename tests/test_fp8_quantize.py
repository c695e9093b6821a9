"""BF16 -> FP8 block quantization (p2pweights.sender.fp8): the formula of docs/fp8.md, pinned on CPU."""
from __future__ import annotations

import pytest
import torch

from p2pweights.errors import NonFiniteTensor, UnsupportedTensor
from p2pweights.models.fp8_format import (
    FP8_E4M3_MAX,
    MIN_SCALE_INV,
    ceil_to_power_of_two,
    dequantize_block_fp8,
    quantize_block_fp8,
)


def _bytes(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(torch.uint8).flatten().tolist()


def _random_weight(rows: int, cols: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    # blocks of very different magnitudes, so every scale differs
    w *= torch.logspace(-3, 2, rows).unsqueeze(1)
    return w.to(dtype)


def _reference_by_loop(w: torch.Tensor, block, ue8m0=False):
    """The formula of docs/fp8.md, one block at a time, written independently of the module."""
    rows, cols = w.shape
    bo, bi = block
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-rows // bo), -(-cols // bi), dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi].to(torch.float32)
            scale = torch.clamp_min(blk.abs().max() / 448.0, 2.0 ** -126)
            if ue8m0:
                scale = torch.tensor(2.0 ** torch.ceil(torch.log2(scale)).item(), dtype=torch.float32)
            q[i * bo:(i + 1) * bo, j * bi:(j + 1) * bi] = (blk * (1.0 / scale)).clamp(-448, 448).to(torch.float8_e4m3fn)
            s[i, j] = scale
    return q, s


def test_outputs_are_fp8_weight_of_the_same_shape_and_float32_scales_per_128x128_block():
    w = _random_weight(7168 // 8, 2048 // 8)
    q, s = quantize_block_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and q.is_contiguous()
    assert s.dtype == torch.float32 and s.shape == (7, 2) and s.is_contiguous()


def test_hand_computed_bytes_of_a_tiny_tensor_in_2x2_blocks():
    w = torch.tensor([[3.0, 0.1, 0.0, 0.0, 448.0, 17.0],
                      [-0.3, 1.5, 0.0, 0.0, 19.0, -0.0]], dtype=torch.float32)
    q, s = quantize_block_fp8(w, block=(2, 2))
    # block 0: amax 3, scale 3/448; 3 -> 448, 0.1 -> 14.93 -> 15, -0.3 -> -44.8 -> -44, 1.5 -> 224
    # block 1: all zero -> scale 2**-126, zeros; block 2: amax 448 -> scale 1, 17 and 19 are ties
    # that round to even (16, 20), -0.0 keeps its sign
    assert s.tolist() == [[(torch.tensor(3.0) / 448.0).item(), 2.0 ** -126, 1.0]]
    assert _bytes(q) == [0x7E, 0x57, 0x00, 0x00, 0x7E, 0x58,
                         0xE3, 0x76, 0x00, 0x00, 0x5A, 0x80]
    assert q.to(torch.float32).tolist() == [[448.0, 15.0, 0.0, 0.0, 448.0, 16.0], [-44.0, 224.0, 0.0, 0.0, 20.0, -0.0]]


def test_the_quotient_is_a_multiply_by_the_float32_reciprocal_not_a_division():
    # amax 49/64: scale_inv = 7/4096 exactly; 1/scale_inv rounds to 585.1428833 in float32, so
    # 0.1982421875 * it = 116.0000076 -> 120 (0x6F), while 0.1982421875 / scale_inv = 116 exactly,
    # a tie that rounds to even -> 112 (0x6E). sglang's per_block_cast_to_fp8 multiplies.
    w = torch.tensor([[0.765625, 0.1982421875]], dtype=torch.bfloat16)
    q, s = quantize_block_fp8(w, block=(1, 2))
    assert s.item() == 7 / 4096
    assert _bytes(q) == [0x7E, 0x6F]


def test_a_128x128_block_scales_its_largest_magnitude_to_448():
    w = torch.full((128, 128), 0.5, dtype=torch.bfloat16)
    w[5, 7] = -2.0
    q, s = quantize_block_fp8(w)
    assert s.tolist() == [[(torch.tensor(2.0) / 448.0).item()]]
    # -2 -> -448 (0xFE); 0.5 -> 112 = 1.75 * 2**6 (0x6E), everywhere else
    assert q[5, 7].to(torch.float32).item() == -448.0
    b = _bytes(q)
    assert b[5 * 128 + 7] == 0xFE and b.count(0x6E) == 128 * 128 - 1


def test_round_trip_error_is_at_most_half_an_fp8_ulp_at_the_blocks_scale():
    w = _random_weight(512, 384, dtype=torch.float32, seed=1)
    q, s = quantize_block_fp8(w)
    deq = dequantize_block_fp8(q, s)
    scale = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    # E4M3 has 3 mantissa bits: half an ulp is 2**-4 of the value (normals), 2**-10 of the scale (subnormals)
    bound = (w.abs() * 2.0 ** -4 + scale * 2.0 ** -10) * (1 + 2.0 ** -18)
    assert bool(((deq - w).abs() <= bound).all())
    # and the block maxima come back exactly scaled to +-448
    assert q.to(torch.float32).abs().amax().item() == FP8_E4M3_MAX


def test_an_all_zero_block_gets_the_smallest_normal_scale_and_zero_bytes():
    w = _random_weight(256, 256)
    w[128:, :128] = 0
    q, s = quantize_block_fp8(w)
    assert s[1, 0].item() == MIN_SCALE_INV == 2.0 ** -126
    assert set(_bytes(q[128:, :128])) == {0}
    assert bool((dequantize_block_fp8(q, s)[128:, :128] == 0).all())
    # a block of subnormal values gets the same floor, never an infinite reciprocal
    tiny = torch.full((128, 128), 1e-40, dtype=torch.float32)
    q, s = quantize_block_fp8(tiny)
    assert s.item() == 2.0 ** -126 and bool(torch.isfinite(q.to(torch.float32)).all())


@pytest.mark.parametrize("ue8m0", [False, True])
def test_partial_edge_blocks_of_a_300x200_weight_are_quantized_over_their_own_elements(ue8m0):
    w = _random_weight(300, 200, seed=2)
    w[256:, 128:] *= 1000  # the corner block, 44x72 elements, has its own scale
    q, s = quantize_block_fp8(w, scale_fmt="ue8m0" if ue8m0 else None)
    assert q.shape == (300, 200) and s.shape == (3, 2)
    q_ref, s_ref = _reference_by_loop(w, (128, 128), ue8m0=ue8m0)
    assert _bytes(s) == _bytes(s_ref)
    assert _bytes(q) == _bytes(q_ref)
    assert s[2, 1].item() >= w[256:, 128:].float().abs().max().item() / 448.0


def test_ue8m0_scales_are_powers_of_two_that_round_up():
    w = _random_weight(384, 256, seed=3)
    q, s = quantize_block_fp8(w, scale_fmt="ue8m0")
    _, plain = quantize_block_fp8(w)
    mantissa, _ = torch.frexp(s)
    assert bool((mantissa == 0.5).all())  # a power of two: frexp's mantissa is exactly 1/2
    assert bool((s >= plain).all()) and bool((s < 2 * plain).all())
    assert q.to(torch.float32).abs().amax().item() <= FP8_E4M3_MAX
    assert ceil_to_power_of_two(torch.tensor([1.0, 1.5, 0.25, 3 / 448, 2.0 ** -126])).tolist() == [
        1.0, 2.0, 0.25, 2.0 ** -7, 2.0 ** -126]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused_naming_the_tensor(bad):
    w = _random_weight(300, 200)
    w[299, 199] = bad
    with pytest.raises(NonFiniteTensor, match="layers.3.mlp.down_proj.weight") as e:
        quantize_block_fp8(w, name="model.layers.3.mlp.down_proj.weight")
    assert e.value.parameter == "model.layers.3.mlp.down_proj.weight"
    assert "1 NaN/Inf" in str(e.value)


def test_inputs_that_are_not_2d_floating_tensors_are_refused():
    with pytest.raises(UnsupportedTensor, match="2-D"):
        quantize_block_fp8(torch.zeros(2, 2, 2), name="x")
    with pytest.raises(UnsupportedTensor, match="int32"):
        quantize_block_fp8(torch.zeros(2, 2, dtype=torch.int32), name="x")
    with pytest.raises(ValueError, match="scale_fmt"):
        quantize_block_fp8(torch.zeros(2, 2), scale_fmt="e8m0")


def test_the_same_input_gives_the_same_bytes_twice():
    w = _random_weight(640, 384, seed=4)
    a, b = quantize_block_fp8(w), quantize_block_fp8(w.clone())
    assert _bytes(a[0]) == _bytes(b[0]) and _bytes(a[1]) == _bytes(b[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_weight_quantizes_exactly_as_its_values_in_float32(dtype):
    w = _random_weight(300, 200, dtype=dtype, seed=5)
    for fmt in (None, "ue8m0"):
        q, s = quantize_block_fp8(w, scale_fmt=fmt)
        q32, s32 = quantize_block_fp8(w.to(torch.float32), scale_fmt=fmt)
        assert _bytes(q) == _bytes(q32) and _bytes(s) == _bytes(s32)


def test_ue8m0_bytes_equal_sglangs_own_per_block_cast_to_fp8():
    import importlib

    from p2pweights.replica import sglang_env

    sglang_env.prepare()  # sglang imported as the replica imports it (CPU host, stubs it needs)
    fp8_utils = importlib.import_module("sglang.srt.layers.quantization.fp8_utils")
    w = _random_weight(300, 200, seed=6)  # every block's amax is far above sglang's 1e-4 floor
    q, s = quantize_block_fp8(w, scale_fmt="ue8m0")
    q_sgl, s_sgl = fp8_utils.per_block_cast_to_fp8(w)
    assert _bytes(q) == _bytes(q_sgl) and _bytes(s) == _bytes(s_sgl.float())
