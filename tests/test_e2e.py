"""End to end: WeightSender -> real Mooncake/NIXL -> receiver processes holding sglang models.

Every engine rank checks, byte for byte, that its weights (and derived buffers) equal what sglang's
own load_weights makes of the same HF tensors. The in-process loopback transport is not used here.
"""
from __future__ import annotations

import time

import pytest
import torch

from p2pweights.control import SglangEngine
from p2pweights.errors import LayoutMismatch, MissingTensors, UnknownParameter, UpdateFailed
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
from p2pweights.receiver import check_weights_equal, start_engines
from p2pweights.replica import ModelReplicas
from p2pweights.sender import WeightSender
from replica_configs import write_config


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    d = tmp_path_factory.mktemp("configs")
    return {"dense": write_config("qwen3", str(d)), "moe": write_config("qwen3_moe", str(d))}


def _clients(engines):
    return [SglangEngine(e.url, name=e.name) for e in engines]


def _push_all(sender, version, seed, specs):
    with sender.update(version) as update:
        for name, t in random_checkpoint(specs, seed):
            update.push(name, t)
    return update.report


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
@pytest.mark.parametrize("kind, layout", [("dense", "tp=2"), ("moe", "tp=2,ep=2")])
def test_p2p_update_is_byte_exact_on_every_engine_rank(configs, transport, kind, layout):
    cfg = configs[kind]
    engines = start_engines(cfg, layout, count=2, transport=transport, name_prefix=f"{kind}-{transport}-")
    try:
        specs = checkpoint_tensors(cfg)
        # two senders (data replicas), each writing the engine ranks the planner gives it
        senders = [WeightSender(cfg, sender_index=i, num_senders=2, transport=transport, buffer_size=1 << 20)
                   for i in range(2)]
        for s in senders:
            s.connect(_clients(engines))
        for step in (1, 2):
            from p2pweights.control import UpdateSession

            with UpdateSession(_clients(engines), f"v{step}"):
                reports = []
                for s in senders:
                    with s.update(f"v{step}", control=False) as u:
                        for name, t in random_checkpoint(specs, step):
                            u.push(name, t)
                    reports.append(u.report)
            assert sum(len(r.engines) for r in reports) == 4  # every (engine, rank) written by exactly one sender
            assert all(e.state == "ok" and e.bytes > 0 for r in reports for e in r.engines)
            for e in engines:
                result = check_weights_equal(e.url, hf_seed=step)
                assert result["success"], result["message"]
                assert SglangEngine(e.url).weight_version() == f"v{step}"
        # and a check against the wrong seed fails: the check can fail
        assert not check_weights_equal(engines[0].url, hf_seed=99)["success"]
        for s in senders:
            s.close()
    finally:
        for e in engines:
            e.close()


def test_killed_engine_fails_the_update_naming_it_and_reconnect_reuses_the_replicas(configs):
    cfg = configs["dense"]
    engines = start_engines(cfg, "tp=1", count=2, transport="mooncake", name_prefix="fault")
    replicas = ModelReplicas()
    try:
        specs = checkpoint_tensors(cfg)
        sender = WeightSender(cfg, transport="mooncake", buffer_size=1 << 20, transfer_timeout=5, replicas=replicas)
        sender.connect(_clients(engines))
        _push_all(sender, "v1", 1, specs)
        builds = replicas.builds

        update = sender.update("v2")
        items = list(random_checkpoint(specs, 2))
        for name, t in items[: len(items) // 2]:
            update.push(name, t)
        engines[1].kill()  # in the middle of the update
        t0 = time.monotonic()
        with pytest.raises(UpdateFailed) as info:
            for name, t in items[len(items) // 2:]:
                update.push(name, t)
            update.finish()
        assert time.monotonic() - t0 < 5 + 5  # by the 5 s transfer timeout, not never (margin for 2 loaded cores)
        assert list(info.value.failures) == ["fault1/rank0"]
        assert info.value.report.engine("fault0/rank0").state == "ok"  # the other engine completed
        # no engine bumped its version
        assert SglangEngine(engines[0].url).weight_version() == "v1"

        engines[1].restart()
        sender.connect(_clients(engines))  # rebuilds connections only
        assert replicas.builds == builds
        report = _push_all(sender, "v3", 3, specs)
        assert all(e.state == "ok" for e in report.engines)
        for e in engines:
            assert check_weights_equal(e.url, hf_seed=3)["success"]
            assert SglangEngine(e.url).weight_version() == "v3"
        sender.close()
    finally:
        for e in engines:
            e.close()


def test_bad_input_gives_clear_errors_and_bumps_no_version(configs):
    cfg = configs["dense"]
    engines = start_engines(cfg, "tp=1", count=1, transport="nixl", name_prefix="bad")
    try:
        specs = checkpoint_tensors(cfg)
        sender = WeightSender(cfg, transport="nixl", buffer_size=1 << 20)
        sender.connect(_clients(engines))
        name, spec = next(iter(specs.items()))
        update = sender.update("v1")
        with pytest.raises(UnknownParameter, match="model.layers.0.self_attn.q_prj.weight"):
            update.push("model.layers.0.self_attn.q_prj.weight", torch.zeros(1))
        with pytest.raises(LayoutMismatch, match=r"expects shape"):
            update.push(name, torch.zeros(3, dtype=torch.bfloat16))
        with pytest.raises(LayoutMismatch, match="dtype"):
            update.push(name, torch.zeros(spec.shape, dtype=torch.float32))
        for n, t in list(random_checkpoint(specs, 1))[:-1]:  # all but the last tensor
            update.push(n, t)
        with pytest.raises(MissingTensors, match=list(specs)[-1].replace(".", r"\.")):
            update.finish()
        assert SglangEngine(engines[0].url).weight_version() != "v1"
        # after a failed update, the next one succeeds
        _push_all(sender, "v2", 2, specs)
        assert check_weights_equal(engines[0].url, hf_seed=2)["success"]
        sender.close()
    finally:
        for e in engines:
            e.close()


def test_broadcast_baseline_is_byte_exact(configs):
    from p2pweights.baseline.broadcast import BroadcastSender

    cfg = configs["moe"]
    engines = start_engines(cfg, "tp=2", count=2, transport="mooncake", name_prefix="bcast")
    try:
        specs = checkpoint_tensors(cfg)
        with BroadcastSender(_clients(engines), backend="gloo") as b:
            report = b.update(list(random_checkpoint(specs, 5)), version="b1")
        assert report.bytes == sum(s.nbytes for s in specs.values())
        for e in engines:
            assert check_weights_equal(e.url, hf_seed=5)["success"]
    finally:
        for e in engines:
            e.close()


def test_demo_runs_p2p_and_broadcast_with_sender_processes(configs):
    """The main job's path: engines, forked sender processes, both modes, the equality check."""
    from p2pweights.commands.demo_run import results_json, run_demo

    lines = []
    results = run_demo(configs["moe"], engines=2, engine="tp=2", senders=2, steps=1, transport="nixl",
                       modes=("p2p", "broadcast"), progress=lines.append)
    steps = results_json(results)["steps"]
    assert [(s["mode"], s["step"]) for s in steps] == [("p2p", 1), ("broadcast", 1)]
    assert all(s["equal"] is True and s["seconds"] > 0 and s["bytes"] > 0 for s in steps)
    assert any("senders connected" in line for line in lines)


def test_each_pp_stage_pushes_only_its_own_parameters(configs):
    """A trainer with PP 2: stage 0 pushes embeddings and the first layers, stage 1 the rest; together
    they produce sglang's exact bytes, and a stage refuses another stage's tensors."""
    from p2pweights.control import UpdateSession
    from p2pweights.errors import P2PWeightsError
    from p2pweights.models import stage_hf_names

    cfg = configs["dense"]
    engines = start_engines(cfg, "tp=2", count=1, transport="mooncake", name_prefix="pp")
    try:
        specs = checkpoint_tensors(cfg)
        stages = [WeightSender(cfg, pp_stage=s, pp_size=2, transport="mooncake", buffer_size=1 << 20) for s in (0, 1)]
        for s in stages:
            s.connect(_clients(engines))
        names = [set(stage_hf_names(specs, 2, s, 2)) for s in (0, 1)]
        assert names[0].isdisjoint(names[1]) and names[0] | names[1] == set(specs)
        assert any("embed_tokens" in n for n in names[0]) and any(n.startswith("model.norm") for n in names[1])
        tensors = dict(random_checkpoint(specs, 4))
        with UpdateSession(_clients(engines), "pp-4"):
            for stage, sender in enumerate(stages):
                with sender.update("pp-4", control=False) as u:
                    for n in sorted(names[stage]):
                        u.push(n, tensors[n])
        assert check_weights_equal(engines[0].url, hf_seed=4)["success"]
        other = next(iter(names[1]))
        update = stages[0].update("pp-5", control=False)
        with pytest.raises(P2PWeightsError, match="another sender"):
            update.push(other, tensors[other])
        for s in stages:
            s.close()
    finally:
        for e in engines:
            e.close()


@pytest.mark.parametrize("count", [2, 4])
def test_a_stages_senders_split_its_layers_each_writing_its_own_to_every_engine_rank(configs, count):
    """split="layers": each of a stage's senders pushes only its layers (the embedding with the
    first, the head with the last) and writes them to its group's engine ranks: two senders of two
    layers are one group (each prepares every engine rank), four are two groups (each one rank of
    both engines); together sglang's exact bytes, and a sender refuses another's tensors."""
    from p2pweights.control import UpdateSession
    from p2pweights.errors import P2PWeightsError
    from p2pweights.models import writer_hf_names

    cfg = configs["dense"]
    engines = start_engines(cfg, "tp=2", count=2, transport="mooncake", name_prefix="split")
    try:
        specs = checkpoint_tensors(cfg)
        senders = [WeightSender(cfg, sender_index=k, num_senders=count, split="layers", transport="mooncake",
                                buffer_size=1 << 20) for k in range(count)]
        for k, s in enumerate(senders):
            s.connect(_clients(engines))
            ranks = {p.rank for p in s.prepared}
            assert ranks == ({0, 1} if count == 2 else {k // 2}) and {len(p.targets) for p in s.prepared} == {2}
        names = [set(writer_hf_names(specs, 2, 0, 1, k % 2, 2)) for k in range(count)]
        assert names[0].isdisjoint(names[1]) and names[0] | names[1] == set(specs) and all(names)
        tensors = dict(random_checkpoint(specs, 8))
        with UpdateSession(_clients(engines), f"split-{count}"):
            for k, sender in enumerate(senders):
                with sender.update(f"split-{count}", control=False) as u:
                    for n in sorted(names[k]):
                        u.push(n, tensors[n])
        for e in engines:
            assert check_weights_equal(e.url, hf_seed=8)["success"]
        other = next(iter(names[1]))
        with pytest.raises(P2PWeightsError, match="another sender"):
            senders[0].update("split-9", control=False).push(other, tensors[other])
        for s in senders:
            s.close()
    finally:
        for e in engines:
            e.close()


def test_sender_memory_stays_bounded_by_slots_and_incomplete_groups(tmp_path):
    """Invariant 6: besides its slots, a sender holds only the HF inputs of groups still incomplete
    and at most a slot's worth of inputs of groups placed in the current slot; never the model."""
    cfg = write_config("qwen3", str(tmp_path), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       vocab_size=4096)
    engines = start_engines(cfg, "tp=2", count=1, transport="mooncake", name_prefix="mem")
    try:
        specs = checkpoint_tensors(cfg)
        sender = WeightSender(cfg, transport="mooncake", buffer_size=1 << 20)  # slots of 2 MiB
        sender.connect(_clients(engines))
        slot_bytes = sender._buffers.slot_bytes
        largest_inputs = max(sum(specs[n].nbytes for n in g.hf_names)
                             for p in sender.prepared for g in p.replica.groups)
        model_bytes = sum(s.nbytes for s in specs.values())
        update = sender.update("m1")
        # every layer's q_proj first: those groups (q/k/v -> qkv_proj) stay incomplete for a while
        items = sorted(random_checkpoint(specs, 6), key=lambda kv: ("q_proj" not in kv[0], kv[0]))
        peak = 0
        for name, t in items:
            update.push(name, t)
            # distinct tensors the sender still references (two engine ranks share the same inputs)
            refs = {t.data_ptr(): t.numel() * t.element_size()
                    for p in sender.prepared for g in p.stager._staged.values() for t in g.values()}
            refs.update({t.data_ptr(): t.numel() * t.element_size() for t in update.pipeline.placed_tensors()})
            held = sum(refs.values())
            peak = max(peak, held)
            assert update.pipeline.placed_input_bytes <= slot_bytes + largest_inputs
        update.finish()
        assert update.pipeline.placed_input_bytes == 0 and all(p.stager.staged_bytes == 0 for p in sender.prepared)
        assert peak < 0.75 * model_bytes  # never a full copy of the model's inputs
        assert check_weights_equal(engines[0].url, hf_seed=6)["success"]
        sender.close()
    finally:
        for e in engines:
            e.close()
