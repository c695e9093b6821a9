"""The bulk push (sender/bulk_push.py): ``push_many`` and ``push_fused`` give exactly ``push``'s
results — byte-exact updates, the same conversions (tied names, DTensor, cast) and the same refusals
naming the tensor — while the common case skips ``push``'s per-tensor Python.

Real receiver processes (sglang models) over Mooncake on loopback.
"""
from __future__ import annotations

import pytest
import torch

from p2pweights.control import SglangEngine
from p2pweights.errors import LayoutMismatch, NonFiniteTensor, P2PWeightsError, UnknownParameter
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
from p2pweights.receiver import check_weights_equal, start_engines
from p2pweights.sender import WeightSender
from p2pweights.sender.update import Update
from replica_configs import write_config


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    # qwen3 ties its word embeddings: lm_head.weight is a tied name the engine loads nothing from
    cfg = write_config("qwen3", str(tmp_path_factory.mktemp("bulk")), hidden_size=128, intermediate_size=256,
                       num_hidden_layers=2, vocab_size=512)
    yield from _engine_and_sender(cfg, "bulk")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    cfg = write_config("qwen3_moe", str(tmp_path_factory.mktemp("bulk-moe")))
    yield from _engine_and_sender(cfg, "bulkmoe")


def _engine_and_sender(cfg, prefix):
    """One tp=2 receiver engine over Mooncake and a sender connected to it: (config, engine, sender)."""
    (e,) = start_engines(cfg, "tp=2", count=1, transport="mooncake", name_prefix=prefix)
    s = WeightSender(cfg, transport="mooncake", buffer_size=1 << 20)
    s.connect([SglangEngine(e.url, name=e.name)])
    yield cfg, e, s
    s.close()
    e.close()


def _tensors(cfg, seed):
    return list(random_checkpoint(checkpoint_tensors(cfg), seed))


@pytest.fixture
def counted(monkeypatch):
    """How many tensors went through Update.push (the per-tensor path)."""
    calls: list[str] = []
    original = Update.push

    def push(self, name, tensor):
        calls.append(name)
        return original(self, name, tensor)

    monkeypatch.setattr(Update, "push", push)
    return calls


@pytest.mark.parametrize("form", ["dict", "pairs"])
def test_push_many_of_a_dict_or_of_pairs_is_byte_exact_without_the_per_tensor_path(dense, counted, form):
    cfg, engine, sender = dense
    tensors = _tensors(cfg, 11)
    with sender.update(f"bulk-{form}", delta=False) as u:
        u.push_many(dict(tensors) if form == "dict" else iter(tensors))
    assert check_weights_equal(engine.url, hf_seed=11)["success"]
    assert counted == []  # every tensor was admitted by the table
    assert u.report.bytes > 0


def test_push_many_converts_what_push_converts_tied_names_and_cast(dense, counted):
    cfg, engine, sender = dense
    tensors = _tensors(cfg, 12)
    embed = dict(tensors)["model.embed_tokens.weight"]
    mixed = [(n, t.float()) if i % 3 == 0 else (n, t) for i, (n, t) in enumerate(tensors)]
    with sender.update("bulk-mixed", cast=True, delta=False) as u:
        u.push_many(mixed + [("lm_head.weight", embed)])  # HF's state_dict() lists the tied head too
    assert u.report.skipped == ["lm_head.weight"]
    assert check_weights_equal(engine.url, hf_seed=12)["success"]
    # the float32 tensors and the tied name went through push(); the others did not
    assert sorted(counted) == sorted([n for i, (n, _) in enumerate(tensors) if i % 3 == 0] + ["lm_head.weight"])


def test_a_refused_tensor_amid_a_bulk_push_names_it_and_the_update_goes_on_as_after_push(dense):
    cfg, engine, sender = dense
    tensors = _tensors(cfg, 13)
    k = len(tensors) // 2
    name, good = tensors[k]
    with sender.update("bulk-refused", delta=False) as u:
        with pytest.raises(LayoutMismatch, match=name.replace(".", r"\.")):
            u.push_many(tensors[:k] + [(name, good[:-1])] + tensors[k + 1:])
        # what came before it was staged, nothing after it: push the rest and the update completes
        u.push_many(tensors[k:])
    assert check_weights_equal(engine.url, hf_seed=13)["success"]


def test_a_tensor_pushed_twice_in_one_bulk_push_loses_none_of_the_groups_completed_before_it(dense):
    cfg, engine, sender = dense
    tensors = _tensors(cfg, 17)
    with sender.update("bulk-twice", delta=False) as u:
        with pytest.raises(P2PWeightsError, match="pushed twice"):
            u.push_many(tensors + [tensors[0]])  # one chunk: every group completes, then the refusal
    # every group was placed before the refusal propagated: the update wrote all of them
    assert check_weights_equal(engine.url, hf_seed=17)["success"]


def test_an_unknown_name_in_a_bulk_push_is_refused_naming_it(dense):
    cfg, _, sender = dense
    u = sender.update("bulk-unknown")
    with pytest.raises(UnknownParameter, match="model.layers.0.mlp.gate_prj.weight"):
        u.push_many({"model.layers.0.mlp.gate_prj.weight": torch.zeros(2, 2, dtype=torch.bfloat16)})
    assert "not paused" in u.abort()


def test_check_finite_sees_every_tensor_of_a_bulk_push(dense):
    cfg, _, sender = dense
    tensors = _tensors(cfg, 14)
    name, t = tensors[-1]
    bad = t.clone()
    bad.view(-1)[0] = float("nan")
    u = sender.update("bulk-nan", check_finite=True)
    with pytest.raises(NonFiniteTensor, match=name.replace(".", r"\.")):
        u.push_many(tensors[:-1] + [(name, bad)])
    u.abort()


def _expert_names(cfg_names, layer: int, proj: str) -> list[str]:
    pre = f"model.layers.{layer}.mlp.experts."
    found = sorted((int(n[len(pre):].split(".")[0]), n) for n in cfg_names
                   if n.startswith(pre) and n.endswith(f".{proj}.weight"))
    return [n for _, n in found]


def test_push_fused_takes_experts_stacked_on_dim_0_as_views(moe, counted):
    cfg, engine, sender = moe
    tensors = dict(_tensors(cfg, 15))
    fused: list[tuple[list[str], torch.Tensor]] = []
    for layer in range(2):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names = _expert_names(tensors, layer, proj)
            assert len(names) == 8
            fused.append((names, torch.stack([tensors.pop(n) for n in names])))  # Megatron's grouped weights
    with sender.update("fused", delta=False) as u:
        for names, stacked in fused:
            u.push_fused(names, stacked)
        u.push_many(tensors)
    assert check_weights_equal(engine.url, hf_seed=15)["success"]
    assert counted == []


def test_push_fused_refuses_a_stack_that_does_not_match_its_names(moe):
    cfg, _, sender = moe
    tensors = dict(_tensors(cfg, 16))
    names = _expert_names(tensors, 0, "gate_proj")
    u = sender.update("fused-bad")
    with pytest.raises(LayoutMismatch, match="dim 0"):
        u.push_fused(names, torch.stack([tensors[n] for n in names[:-1]]))
    assert "not paused" in u.abort()
