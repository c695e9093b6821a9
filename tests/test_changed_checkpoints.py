"""The changed checkpoint family (``random_checkpoint(..., changed=(fraction, steps))``, the data of
delta updates): version 0 and fraction 0 are the seed's checkpoint, fraction 1 redraws every element,
each step changes about the fraction asked for, uniformly spread and independently of the other
steps, the same from any process; FP8 checkpoints quantize the changed BF16 tensors. The equality
check's fields for it are typed, and a real engine's check follows the version asked for.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
import torch

from p2pweights.control import bodies
from p2pweights.errors import EngineError, InvalidRequest
from p2pweights.models import checkpoint as ckpt
from p2pweights.models import load_config
from p2pweights.models.checkpoint import RandomCheckpoint, TensorSpec, checkpoint_tensors, random_tensor, trainer_tensors
from p2pweights.models.quant import quant_scheme

BF16 = TensorSpec((1000, 1000), "bfloat16")
NAME = "model.layers.3.mlp.down_proj.weight"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element: the bytes differ (a NaN-safe, bit-level comparison)."""
    return bits(a) != bits(b)


def version(steps: int, fraction: float, spec: TensorSpec = BF16, seed: int = 5, name: str = NAME) -> torch.Tensor:
    return random_tensor(name, spec, seed, changed=(fraction, steps))


def test_fraction_zero_and_version_zero_are_the_seeds_checkpoint():
    base = random_tensor(NAME, BF16, 5)
    for fraction, steps in ((0.0, 7), (0.3, 0), (1.0, 0)):
        assert torch.equal(bits(version(steps, fraction)), bits(base)), (fraction, steps)
    specs = {NAME: BF16, "model.norm.weight": TensorSpec((1000,), "float32")}
    for (name, a), (_, b) in zip(ckpt.random_checkpoint(specs, 5, changed=(0.0, 3)), ckpt.random_checkpoint(specs, 5)):
        assert torch.equal(bits(a), bits(b)), name


def test_fraction_one_redraws_every_element_as_the_seed_of_that_step():
    for steps in (1, 4):
        new = version(steps, 1.0)
        assert torch.equal(bits(new), bits(random_tensor(NAME, BF16, 5 + steps)))
        # a redrawn BF16 value equals the old one only by chance (about 0.1% of normal values)
        assert differ(new, version(steps - 1, 1.0)).float().mean() > 0.99


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_each_step_changes_the_fraction_asked_for_uniformly_spread(dtype):
    spec = TensorSpec((1000, 1000), dtype)
    fraction = 0.01
    previous = version(0, fraction, spec)
    for steps in (1, 2, 3):
        current = version(steps, fraction, spec)
        changed = differ(current, previous)
        # ~10,000 of 1M elements (std ~100); a redraw equal to the old value is rare
        assert abs(changed.float().mean().item() - fraction) < 0.0008, (steps, changed.float().mean())
        for quarter in changed.chunk(4):  # spread over the whole tensor, not bunched at its start
            assert abs(quarter.float().mean().item() - fraction) < 0.002
        previous = current


def test_the_steps_pick_their_elements_independently_and_changes_accumulate():
    fraction = 0.1
    v0, v1, v2 = (version(k, fraction) for k in range(3))
    step1, step2 = differ(v1, v0), differ(v2, v1)
    overlap = (step1 & step2).float().mean().item()
    assert abs(overlap - fraction * fraction) < 0.002  # independent: ~F^2 (identical picks: F)
    assert abs(differ(v2, v0).float().mean().item() - (1 - (1 - fraction) ** 2)) < 0.003
    # outside step 2's picks, version 2 is version 1 byte for byte (step 1's values stay)
    picks2 = ckpt._changed_positions(5, 2, NAME, BF16.shape[0] * BF16.shape[1], fraction)
    kept = torch.ones(step2.numel(), dtype=torch.bool)
    kept[picks2] = False
    assert torch.equal(bits(v2)[kept], bits(v1)[kept])
    # step 2's picks hold seed 5 + 2's values there
    assert torch.equal(bits(v2)[picks2], bits(random_tensor(NAME, BF16, 7))[picks2])


def test_other_names_and_seeds_change_other_elements():
    mine = differ(version(1, 0.05), version(0, 0.05))
    other_name = differ(version(1, 0.05, name=NAME + "x"), version(0, 0.05, name=NAME + "x"))
    other_seed = differ(version(1, 0.05, seed=6), version(0, 0.05, seed=6))
    for other in (other_name, other_seed):
        assert (mine & other).float().mean().item() < 0.05 * 0.05 * 2


def test_a_version_is_the_same_bytes_in_every_process():
    here = hashlib.sha256(bits(version(3, 0.02)).numpy().tobytes()).hexdigest()
    assert here == hashlib.sha256(bits(version(3, 0.02)).numpy().tobytes()).hexdigest()
    code = ("import hashlib, torch; from p2pweights.models.checkpoint import random_tensor, TensorSpec; "
            f"t = random_tensor({NAME!r}, TensorSpec((1000, 1000), 'bfloat16'), 5, changed=(0.02, 3)); "
            "print(hashlib.sha256(t.reshape(-1).view(torch.int16).numpy().tobytes()).hexdigest())")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.strip()
    assert there == here


def test_many_steps_stop_once_every_element_has_its_last_change(monkeypatch):
    calls = []
    real = ckpt._changed_positions
    monkeypatch.setattr(ckpt, "_changed_positions", lambda *a: calls.append(a[1]) or real(*a))
    spec = TensorSpec((4000,), "bfloat16")
    out = random_tensor(NAME, spec, 5, changed=(0.5, 10_000))
    assert 0 < len(calls) < 100 and calls[0] == 10_000  # walked back from the last step, not 10,000 passes
    assert differ(out, random_tensor(NAME, spec, 5)).float().mean() > 0.99


def test_fp8_checkpoints_quantize_the_changed_bf16_tensors():
    from p2pweights.models.fp8_format import quantize_block_fp8

    model = "deepseek-v3-fp8-tiny"
    specs, scheme = checkpoint_tensors(model), quant_scheme(load_config(model))
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    changed = RandomCheckpoint(specs, 7, scheme, changed=(0.01, 2))
    source = random_tensor(name, trainer_tensors(model)[name], 7, changed=(0.01, 2))
    q, scale = quantize_block_fp8(source, (128, 128))
    assert torch.equal(bits(changed.tensor(name)), bits(q))
    assert torch.equal(changed.tensor(name + "_scale_inv"), scale)
    base = RandomCheckpoint(specs, 7, scheme)
    assert differ(changed.tensor(name), base.tensor(name)).any()
    assert torch.equal(bits(RandomCheckpoint(specs, 7, scheme, changed=(0.0, 2)).tensor(name)), bits(base.tensor(name)))


@pytest.mark.parametrize("changed", [(1.5, 1), (-0.1, 1), (0.1, -1), (0.1, 1.0), ("0.1", 1), (0.1, True)])
def test_a_wrong_version_is_refused(changed):
    with pytest.raises(ValueError, match="changed"):
        random_tensor(NAME, BF16, 5, changed=changed)


# -- the equality check's fields --------------------------------------------------------------------------
@pytest.mark.parametrize("extra,field", [
    ({"changed_fraction": "0.1", "changed_steps": 1}, "changed_fraction"),
    ({"changed_fraction": 1.5, "changed_steps": 1}, "changed_fraction"),
    ({"changed_fraction": float("nan"), "changed_steps": 1}, "changed_fraction"),
    ({"changed_fraction": 0.1, "changed_steps": 1.0}, "changed_steps"),
    ({"changed_fraction": 0.1, "changed_steps": -1}, "changed_steps"),
    ({"changed_fraction": 0.1, "changed_steps": False}, "changed_steps"),
    ({"changed_fraction": 0.1}, "changed_steps"),
    ({"changed_steps": 2}, "changed_fraction"),
])
def test_the_checks_changed_fields_are_typed_on_both_sides(extra, field):
    body = {"action": "p2pw_compare", "hf_seed": 7, **extra}
    with pytest.raises(InvalidRequest, match=field):
        bodies.decode(bodies.CheckWeightsReq, body)
    with pytest.raises(InvalidRequest, match=field):
        bodies.encode(bodies.CheckWeightsReq(action="p2pw_compare", extra={"hf_seed": 7, **extra}))
    with pytest.raises(InvalidRequest, match=field):
        bodies.decode(bodies.RankCompareReq, {"hf_seed": 7, **extra})


def test_the_checks_changed_fields_pass_as_sent():
    body = {"action": "p2pw_compare", "hf_seed": 7, "changed_fraction": 0.01, "changed_steps": 3}
    assert bodies.decode(bodies.CheckWeightsReq, body).extra == {k: body[k] for k in list(body)[1:]}
    assert bodies.encode(bodies.decode(bodies.CheckWeightsReq, body)) == {**body, "allow_quant_error": False,
                                                                         "selector": "all"}
    rank = bodies.decode(bodies.RankCompareReq, {"hf_seed": 7, "changed_fraction": 1, "changed_steps": 0})
    assert (rank.changed_fraction, rank.changed_steps) == (1, 0)


# -- a real engine ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from conftest import require_sglang

    require_sglang()
    sys.path.insert(0, os.path.dirname(__file__))
    from p2pweights.receiver import start_engine
    from replica_configs import write_config

    config = write_config("qwen3", str(tmp_path_factory.mktemp("configs")))
    running = start_engine(config, "tp=2", transport="mooncake", name="changed")
    yield running, config
    running.close()


def write_version(engine, config: str, seed: int, changed: tuple[float, int]) -> None:
    """One update writing every rank's parameters as sglang's loader makes them of that version."""
    from p2pweights.control import SglangEngine, UpdateSession
    from p2pweights.models.engine_layout import EngineLayout
    from p2pweights.replica.reference import ReferenceModel, tensor_bytes
    from p2pweights.sender.buffers import TransferBuffers
    from p2pweights.sender.writer import PipelinedWriter
    from p2pweights.transport import EnginePublication, attach_engine, make_sender_transport, param_writes

    client = SglangEngine(engine.url, name=engine.name)
    transport = make_sender_transport(engine.transport)
    buffers = TransferBuffers(4 << 20, 2)
    transport.register_memory(buffers.address, buffers.total_bytes, buffers.location)
    writer = PipelinedWriter(transport, buffers, transfer_timeout=10)
    try:
        with UpdateSession([client], version=f"{seed}-{changed[1]}"):
            for rank in range(engine.world):
                pub = EnginePublication.from_json(client.transfer_engine_info(rank))
                name = f"{engine.name}/rank{rank}"
                attach_engine(transport, writer, rank, name, pub)
                model, _ = ReferenceModel(config, EngineLayout.parse(engine.engine), rank).loaded(seed, changed)
                slot = writer.acquire()
                view, entries, pos = buffers.slot_tensor(slot), [], 0
                for pname, p in model.named_parameters():
                    data = tensor_bytes(p)
                    view[pos:pos + data.numel()] = data
                    entries.append((pname, pos, data.numel()))
                    pos += data.numel()
                writer.submit(slot, param_writes(pub, rank, name, entries))
            assert writer.finish().ok
    finally:
        writer.close()
        transport.close()
        buffers.close()


def test_a_real_engines_check_follows_the_changed_version_asked_for(engine):
    from p2pweights.receiver import check_weights_equal

    running, config = engine
    write_version(running, config, 11, (0.05, 3))
    same = check_weights_equal(running.url, hf_seed=11, changed_fraction=0.05, changed_steps=3)
    assert same["success"], same["message"]
    assert "changed_steps 3" in same["message"]
    assert all(r["equal"] and r["changed_steps"] == 3 and r["changed_fraction"] == 0.05 for r in same["ranks"])
    for other in ({"changed_fraction": 0.05, "changed_steps": 2}, {}):  # the version before, the seed's own
        answer = check_weights_equal(running.url, hf_seed=11, **other)
        assert not answer["success"] and answer["mismatches"], other
    with pytest.raises(EngineError, match="changed_steps"):  # one field without the other: the engine's 400
        check_weights_equal(running.url, hf_seed=11, changed_fraction=0.05)
