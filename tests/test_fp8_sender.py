"""Quantize on send into FP8 block-quantized engines (issue 15, the sender's side).

First the parts that need no engine: the batched quantizer (bytes of one call per weight), the
stager and the push-time checks speaking the trainer's names (a BF16 weight alone, or the
pre-quantized pair), the transform on a real replica's groups. Then FP8 updates into a real engine
(sglang's DeepseekV3 ranks over Mooncake on loopback), byte-checked by the engine's own equality
check (sglang's loader on the FP8 checkpoint the seeded BF16 tensors quantize to).
"""
from __future__ import annotations

import pytest
import torch

from p2pweights.errors import LayoutMismatch, MissingTensors, NonFiniteTensor, UnsupportedTensor
from p2pweights.models.checkpoint import TensorSpec
from p2pweights.models.fp8_format import quantize_block_fp8
from p2pweights.sender import fp8 as sender_fp8
from p2pweights.sender.fp8 import quantize_many
from p2pweights.sender.inputs import TrainerInputs
from p2pweights.sender.stager import GroupStager

W = "model.layers.1.mlp.down_proj.weight"
S = W + "_scale_inv"
NORM = "model.layers.1.post_attention_layernorm.weight"


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _weights(n: int, rows: int, cols: int, dtype=torch.bfloat16, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rows, cols, generator=g) * 10.0 ** (i % 5 - 3)).to(dtype) for i in range(n)]


# -- the batched quantizer ------------------------------------------------------------------------
@pytest.mark.parametrize("rows, cols, fmt, per_call", [
    (256, 384, None, 3),        # whole blocks, chunks of 3 (the last one shorter)
    (300, 200, None, 2),        # partial edge blocks in both dimensions: rows padded per weight
    (300, 200, "ue8m0", 100),   # one call for all
    (129, 4097, None, 1),       # chunks of one
])
def test_quantize_many_gives_the_bytes_of_one_call_per_weight(rows, cols, fmt, per_call):
    weights = _weights(7, rows, cols)
    weights[2][:128, :128] = 0  # an all-zero block
    padded = -(-rows // 128) * 128
    out = quantize_many(weights, scale_fmt=fmt, max_batch_bytes=per_call * padded * cols * 2)
    assert len(out) == len(weights)
    for w, (q, s) in zip(weights, out):
        q1, s1 = quantize_block_fp8(w, scale_fmt=fmt)
        assert q.shape == w.shape and q.dtype == torch.float8_e4m3fn and q.is_contiguous()
        assert s.shape == s1.shape and s.dtype == torch.float32 and s.is_contiguous()
        assert _bytes(q) == _bytes(q1) and _bytes(s) == _bytes(s1)


def test_quantize_many_quantizes_a_chunk_in_one_call_of_the_formula(monkeypatch):
    calls = []
    real = sender_fp8.quantize_block_fp8
    monkeypatch.setattr(sender_fp8, "quantize_block_fp8", lambda w, *a, **k: calls.append(w.shape) or real(w, *a, **k))
    quantize_many(_weights(6, 256, 128))
    assert calls == [(6 * 256, 128)]


def test_quantize_many_names_the_weight_that_holds_nan_and_returns_nothing():
    weights = _weights(5, 256, 128)
    weights[3][7, 9] = float("nan")
    names = [f"model.layers.1.mlp.experts.{i}.down_proj.weight" for i in range(5)]
    with pytest.raises(NonFiniteTensor, match=r"experts\.3\.down_proj") as e:
        quantize_many(weights, names=names, max_batch_bytes=2 * 256 * 128 * 2)
    assert e.value.parameter == names[3]


def test_quantize_many_refuses_weights_of_different_shapes_or_dtypes():
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        quantize_many([torch.zeros(128, 128), torch.zeros(128, 256)])
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        quantize_many([torch.zeros(128, 128), torch.zeros(128, 128, dtype=torch.bfloat16)])
    with pytest.raises(UnsupportedTensor, match="int32"):
        quantize_many([torch.zeros(128, 128, dtype=torch.int32)] * 2, names=["a", "b"])


# -- the stager and the push-time checks speak the trainer's names --------------------------------
SPECS = {W: TensorSpec((256, 128), "float8_e4m3fn"), S: TensorSpec((2, 1), "float32"),
         NORM: TensorSpec((128,), "bfloat16")}


def _stager() -> GroupStager:
    return GroupStager([[W, S], [NORM]], SPECS, where="test rank 0")


def _pair(w: torch.Tensor | None = None):
    return quantize_block_fp8(w if w is not None else _weights(1, 256, 128)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_bf16_weight_alone_completes_its_fp8_group_and_no_scale_is_expected(dtype):
    st = _stager()
    w = _weights(1, 256, 128, dtype)[0]
    assert st.missing() == [W, NORM]  # the trainer's names: no scale
    assert st.push(W, w) == (0, {W: w})
    st.push(NORM, torch.zeros(128, dtype=torch.bfloat16))
    st.check_complete()


@pytest.mark.parametrize("scale_first", [False, True])
def test_a_pre_quantized_weight_completes_its_group_only_with_its_scale(scale_first):
    st = _stager()
    q, s = _pair()
    first, second = ((S, s), (W, q)) if scale_first else ((W, q), (S, s))
    assert st.push(*first) is None
    assert S in st.missing() or W in st.missing()
    g, tensors = st.push(*second)
    assert g == 0 and tensors[W] is q and tensors[S] is s


def test_a_group_of_bf16_and_pre_quantized_weights_completes_at_its_last_needed_push():
    w2 = "model.layers.1.mlp.up_proj.weight"
    specs = {**SPECS, w2: TensorSpec((256, 128), "float8_e4m3fn"), w2 + "_scale_inv": TensorSpec((2, 1), "float32")}
    st = GroupStager([[W, S, w2, w2 + "_scale_inv"], [NORM]], specs)
    q, s = _pair()
    assert st.push(W, q) is None  # pre-quantized: waits for its scale
    assert st.push(w2, _weights(1, 256, 128)[0]) is None  # BF16: needs nothing more, but W does
    assert st.missing() == [S, NORM]
    g, tensors = st.push(S, s)
    assert g == 0 and set(tensors) == {W, S, w2}


def test_a_pre_quantized_weight_without_its_scale_is_refused_at_finish_naming_the_scale():
    st = _stager()
    st.push(W, _pair()[0])
    st.push(NORM, torch.zeros(128, dtype=torch.bfloat16))
    assert st.missing() == [S]
    with pytest.raises(MissingTensors, match=r"down_proj\.weight_scale_inv.*never was") as e:
        st.check_complete()
    assert e.value.parameter == S


@pytest.mark.parametrize("order", ["scale_first", "weight_first", "after_complete"])
def test_a_scale_next_to_a_bf16_weight_is_refused_naming_the_scale(order):
    st = _stager()
    w, (_, s) = _weights(1, 256, 128)[0], _pair()
    with pytest.raises(LayoutMismatch, match=r"weight_scale_inv") as e:
        if order == "scale_first":
            st.push(S, s)
            st.push(W, w)
        else:
            st.push(W, w)
            st.push(S, s)
    assert e.value.parameter == S


@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e5m2, torch.float64])
def test_a_weight_that_cannot_be_quantized_is_refused_as_unsupported(dtype):
    with pytest.raises(UnsupportedTensor, match=r"down_proj\.weight.*float8_e4m3fn") as e:
        _stager().push(W, torch.zeros(256, 128, dtype=dtype))
    assert e.value.parameter == W


def test_shapes_and_scale_dtypes_are_still_checked():
    st = _stager()
    with pytest.raises(LayoutMismatch, match=r"shape \(128, 256\)"):
        st.push(W, torch.zeros(128, 256, dtype=torch.bfloat16))
    with pytest.raises(LayoutMismatch, match="float64"):
        st.push(S, torch.ones(2, 1, dtype=torch.float64))
    with pytest.raises(LayoutMismatch, match=r"shape \(1, 2\)"):
        st.push(S, torch.ones(1, 2))
    with pytest.raises(LayoutMismatch, match="float32"):  # an unquantized tensor keeps its exact dtype
        st.push(NORM, torch.zeros(128))


def test_trainer_inputs_check_bf16_weights_for_nan_always_and_never_cast_them():
    inputs = TrainerInputs(SPECS, {}, cast=True)  # check_finite off
    w = _weights(1, 256, 128, torch.float32)[0]
    assert inputs.prepare(W, w) is w  # not cast to float8_e4m3fn: it is quantized on send
    bad = w.clone()
    bad[3, 4] = float("inf")
    with pytest.raises(NonFiniteTensor, match=r"down_proj\.weight.*no block scale") as e:
        inputs.prepare(W, bad)
    assert e.value.parameter == W
    norm = torch.full((128,), float("nan"))
    assert inputs.prepare(NORM, norm).dtype == torch.bfloat16  # unquantized: cast, and NaN passes (as before)


# -- the transform on a real replica's groups -----------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    from p2pweights.models import resolve_model

    return resolve_model("deepseek-v3-fp8-tiny")


@pytest.fixture(scope="module")
def replica(tiny):
    from p2pweights.models.engine_layout import EngineLayout
    from p2pweights.replica import model_replicas

    return model_replicas().get(tiny, EngineLayout.parse("tp=2"), 0)


def _rank(replica, rank=0):
    from p2pweights.sender.prepared import PreparedRank

    return PreparedRank("tp=2", rank, replica, GroupStager([g.hf_names for g in replica.groups], replica.hf_specs))


def _load(replica, group, tensors, rank=0):
    from p2pweights.sender.transforms import GroupLoad

    return GroupLoad(_rank(replica, rank), group, tensors)


def _expert_group(replica):
    return max(replica.groups, key=lambda g: sum(".experts." in n for n in g.hf_names))


def _trainer_tensors(cfg, names, seed):
    from p2pweights.models.checkpoint import random_tensor, trainer_tensors

    specs = trainer_tensors(cfg)
    return {n: random_tensor(n, specs[n], seed) for n in names if n in specs}


def test_the_transform_quantizes_a_groups_bf16_weights_in_one_call_per_shape(tiny, replica, monkeypatch):
    from p2pweights.models.quant import quant_scheme
    from p2pweights.models.registry import load_config
    from p2pweights.sender import quantize as q_module

    scheme = quant_scheme(load_config(tiny))
    group = _expert_group(replica)
    tensors = _trainer_tensors(tiny, group.hf_names, seed=3)
    weights = [n for n in tensors if n.endswith("_proj.weight")]
    assert len(weights) >= 6 and all(n + "_scale_inv" in group.hf_names for n in weights)
    calls = []
    real = q_module.quantize_many
    monkeypatch.setattr(q_module, "quantize_many", lambda ws, *a, **k: calls.append(len(ws)) or real(ws, *a, **k))
    transform = q_module.QuantizeOnSend(scheme)
    transform.connect([_rank(replica, 0), _rank(replica, 1)])  # two prepared ranks read the same tensors
    (out,) = transform(_load(replica, group, tensors))
    assert list(out.tensors) == list(group.hf_names)  # exactly the engine checkpoint's names, in its order
    for n in weights:
        q, s = quantize_block_fp8(tensors[n], scheme.block, scheme.scale_fmt)
        assert _bytes(out.tensors[n]) == _bytes(q) and _bytes(out.tensors[n + "_scale_inv"]) == _bytes(s)
    shapes = {tuple(tensors[n].shape) for n in weights}
    assert sorted(calls) == sorted(sum(tuple(tensors[n].shape) == sh for n in weights) for sh in shapes)
    assert len(calls) < len(weights)
    # another engine rank reading the same, unchanged tensors gets them without quantizing again
    (again,) = transform(_load(replica, group, dict(tensors), rank=1))
    assert len(calls) == len(shapes) and again.tensors[weights[0]] is out.tensors[weights[0]]
    # ... but a tensor changed in place since is quantized anew
    tensors[weights[0]].mul_(2)
    (changed,) = transform(_load(replica, group, dict(tensors)))
    assert calls[-1] == 1
    assert _bytes(changed.tensors[weights[0]]) == _bytes(quantize_block_fp8(tensors[weights[0]])[0])
    # one prepared rank: nothing is kept between groups
    single = q_module.QuantizeOnSend(scheme)
    single.connect([_rank(replica)])
    single(_load(replica, group, tensors))
    assert single._last == {}


def test_pre_quantized_pairs_pass_the_transform_untouched(tiny, replica):
    from p2pweights.models.quant import quant_scheme, scale_name
    from p2pweights.models.registry import load_config
    from p2pweights.sender.quantize import QuantizeOnSend

    group = _expert_group(replica)
    tensors = _trainer_tensors(tiny, group.hf_names, seed=4)
    for n in [n for n in tensors if n.endswith("_proj.weight")]:
        tensors[n], tensors[scale_name(n)] = quantize_block_fp8(tensors[n])
    (out,) = QuantizeOnSend(quant_scheme(load_config(tiny)))(_load(replica, group, dict(tensors)))
    assert all(out.tensors[n] is t for n, t in tensors.items()) and set(out.tensors) == set(tensors)


def test_the_weight_sender_installs_quantize_on_send_only_for_an_fp8_config(tiny, tmp_path):
    from p2pweights.sender import WeightSender
    from p2pweights.sender.quantize import QuantizeOnSend
    from p2pweights.sender.transforms import GroupTransform
    from replica_configs import write_config

    mine = GroupTransform()
    with WeightSender(tiny, transforms=[mine]) as s:
        assert s.transforms[0] is mine and isinstance(s.transforms[-1], QuantizeOnSend)
        assert s.transforms[-1].scheme.block == (128, 128)
    with WeightSender(write_config("qwen3", str(tmp_path))) as s:
        assert s.transforms == ()


# -- FP8 updates into a real engine ---------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny):
    from p2pweights.receiver import start_engines

    (e,) = start_engines(tiny, "tp=2", count=1, transport="mooncake", name_prefix="fp8")
    yield e
    e.close()


@pytest.fixture
def sender(tiny, engine):
    from p2pweights.control import SglangEngine
    from p2pweights.sender import WeightSender

    s = WeightSender(tiny, transport="mooncake", buffer_size=1 << 20)
    s.connect([SglangEngine(engine.url, name=engine.name)])
    yield s
    s.close()


def _client(engine):
    from p2pweights.control import SglangEngine

    return SglangEngine(engine.url, name=engine.name)


def _generating(engine) -> bool:
    return _client(engine).server_info()["p2pw_weight_update"]["state"] == "none"


def _trainer_checkpoint(cfg, seed):
    from p2pweights.models.checkpoint import random_checkpoint, trainer_tensors

    return list(random_checkpoint(trainer_tensors(cfg), seed))


def _equal(engine, seed) -> dict:
    from p2pweights.receiver import check_weights_equal

    return check_weights_equal(engine.url, hf_seed=seed)


def test_an_fp8_update_quantized_on_send_is_byte_exact_in_the_engine(tiny, engine, sender):
    from p2pweights.models.checkpoint import checkpoint_tensors, trainer_tensors

    tensors = _trainer_checkpoint(tiny, 21)
    assert not any(t.dtype == torch.float8_e4m3fn or n.endswith("_scale_inv") for n, t in tensors)
    with sender.update("fp8-21") as u:
        for name, t in tensors:
            u.push(name, t)
    result = _equal(engine, 21)
    assert result["success"], result["message"]
    assert _client(engine).weight_version() == "fp8-21" and _generating(engine)
    # the FP8 checkpoint's bytes went over the wire: well under the BF16 checkpoint's per rank
    engine_bytes = sum(s.nbytes for s in checkpoint_tensors(tiny).values())
    assert engine_bytes < 0.75 * sum(s.nbytes for s in trainer_tensors(tiny).values())
    assert not _equal(engine, 22)["success"]  # the check tells seeds apart


def test_pre_quantized_inputs_pass_through_and_give_the_same_bytes(tiny, engine, sender):
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
    from p2pweights.models.quant import quant_scheme
    from p2pweights.models.registry import load_config

    cfg = load_config(tiny)
    engine_view = list(random_checkpoint(checkpoint_tensors(cfg), 23, quant_scheme(cfg)))
    assert any(t.dtype == torch.float8_e4m3fn for _, t in engine_view)
    with sender.update("fp8-pre-23") as u:
        for name, t in engine_view:
            u.push(name, t)
    result = _equal(engine, 23)  # what quantizing seed 23's BF16 tensors on send gives
    assert result["success"], result["message"]


def _versioned(engine, sender, tiny, seed):
    with sender.update(f"fp8-base-{seed}") as u:
        for name, t in _trainer_checkpoint(tiny, seed):
            u.push(name, t)
    return _client(engine).weight_version()


def _with_nan(tensors, which):
    quantized = [i for i, (n, t) in enumerate(tensors) if n.endswith("_proj.weight") and not n.endswith("eh_proj.weight")]
    i = quantized[which]
    name, t = tensors[i]
    bad = t.clone()
    bad.view(-1)[11] = float("nan")
    return i, name, bad


def test_nan_in_a_bf16_weight_is_refused_before_any_write_or_pause_without_check_finite(tiny, engine, sender):
    before = _versioned(engine, sender, tiny, 30)
    tensors = _trainer_checkpoint(tiny, 32)
    i, name, bad = _with_nan(tensors, 0)
    with pytest.raises(NonFiniteTensor, match=name.replace(".", r"\.")) as e:
        with sender.update("fp8-nan", check_finite=False) as u:
            for n, x in tensors[:i]:
                u.push(n, x)
            u.push(name, bad)  # its group is not complete yet: refused at the push, not when quantized
    assert e.value.parameter == name and "not paused" in u.outcome
    assert _generating(engine) and _client(engine).weight_version() == before
    result = _equal(engine, 30)  # the engine's weights are the last update's
    assert result["success"], result["message"]


def test_nan_mid_update_is_refused_before_its_group_is_written_and_the_update_goes_on(tiny, engine, sender):
    tensors = _trainer_checkpoint(tiny, 35)
    i, name, bad = _with_nan(tensors, -1)
    with sender.update("fp8-nan-mid") as u:
        for n, x in tensors[:i]:
            u.push(n, x)
        with pytest.raises(NonFiniteTensor, match="no block scale"):
            u.push(name, bad)
        for n, x in tensors[i:]:
            u.push(n, x)
    result = _equal(engine, 35)
    assert result["success"], result["message"]


def test_a_pre_quantized_weight_without_its_scale_is_refused_before_any_write(tiny, engine, sender):
    before = _versioned(engine, sender, tiny, 33)
    name, weight = next((n, t) for n, t in _trainer_checkpoint(tiny, 34) if n.endswith("q_b_proj.weight"))
    q, _ = quantize_block_fp8(weight)
    with pytest.raises(MissingTensors, match=r"q_b_proj\.weight_scale_inv") as e:
        with sender.update("fp8-noscale") as u:
            u.push(name, q)
    assert e.value.parameter == name + "_scale_inv"
    assert _generating(engine) and _client(engine).weight_version() == before
    assert _equal(engine, 33)["success"]


# -- the demo ---------------------------------------------------------------------------------------
def test_the_fp8_demo_quantizes_on_send_in_sender_processes_and_is_byte_exact(tiny):
    """`p2pweights demo --model deepseek-v3-fp8-tiny`'s path: forked senders push BF16 trainer
    tensors (NIXL here), the engines' equality check passes on the FP8 checkpoint."""
    from p2pweights.commands.demo_run import results_json, run_demo

    lines = []
    results = run_demo(tiny, engines=1, engine="tp=2", senders=2, steps=1, transport="nixl", modes=("p2p",),
                       progress=lines.append)
    (step,) = results_json(results)["steps"]
    assert step["mode"] == "p2p" and step["equal"] is True, lines


def test_the_demo_refuses_the_gloo_broadcast_for_an_fp8_model_before_starting_engines():
    import argparse

    from p2pweights.commands import demo

    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    with pytest.raises(SystemExit, match="no float8 type; use --modes p2p"):
        demo.run(p.parse_args(["--model", "deepseek-v3-fp8-tiny", "--modes", "p2p,broadcast"]))
