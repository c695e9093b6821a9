"""Receiver engines as real processes (one per engine rank, sglang's model classes), real Mooncake
and NIXL on 127.0.0.1: the published tables, one-sided writes of sglang's own bytes, the equality
check (pass, and a corrupted byte named with its rank), and a killed engine restarted on its port.
Also the receiver's structure: ranks forked from a single-threaded launcher, the broadcast receiver
handed to the rank, one reference model shared with check-layout.
"""
from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from p2pweights.control import SglangEngine, UpdateSession  # noqa: E402
from p2pweights.errors import EngineError  # noqa: E402
from p2pweights.receiver import check_weights_equal, start_engine  # noqa: E402
from p2pweights.sender.buffers import TransferBuffers  # noqa: E402
from p2pweights.sender.writer import PipelinedWriter  # noqa: E402
from p2pweights.transport import EnginePublication, attach_engine, make_sender_transport, param_writes  # noqa: E402
from replica_configs import write_config  # noqa: E402

SLOT = 4 << 20


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    return {name: write_config(name, str(root)) for name in ("qwen3", "qwen3_moe", "deepseek_v3")}


_references: dict = {}


def reference_params(config: str, engine: str, rank: int, seed: int) -> dict:
    """name -> bytes of what sglang's loader puts into each parameter of that rank (the sender's side)."""
    from p2pweights.models.engine_layout import EngineLayout
    from p2pweights.replica.reference import ReferenceModel, tensor_bytes

    key = (config, engine, rank)
    if key not in _references:
        _references[key] = ReferenceModel(config, EngineLayout.parse(engine), rank)
    model, _ = _references[key].loaded(seed)
    return {n: tensor_bytes(p).clone() for n, p in model.named_parameters()}


def write_update(engine, config: str, seed: int, corrupt: tuple[int, str, int] | None = None) -> None:
    """One update: pause, begin, write every parameter of every rank from a real transport through
    the pipelined writer, end, bump, continue. ``corrupt`` = (rank, param, byte) flips that byte."""
    client = SglangEngine(engine.url, name=engine.name)
    transport = make_sender_transport(engine.transport)
    buffers = TransferBuffers(SLOT, 2)
    transport.register_memory(buffers.address, buffers.total_bytes, buffers.location)
    writer = PipelinedWriter(transport, buffers, transfer_timeout=10)
    try:
        with UpdateSession([client], version=f"seed{seed}"):
            for rank in range(engine.world):
                pub = EnginePublication.from_json(client.transfer_engine_info(rank))
                name = f"{engine.name}/rank{rank}"
                attach_engine(transport, writer, rank, name, pub)
                params = reference_params(config, engine.engine, rank, seed)
                slot = writer.acquire()
                view = buffers.slot_tensor(slot)
                entries, pos = [], 0
                for pname, data in params.items():
                    view[pos:pos + data.numel()] = data
                    if corrupt and corrupt[0] == rank and corrupt[1] == pname:
                        view[pos + corrupt[2]] ^= 0xFF
                    entries.append((pname, pos, data.numel()))
                    pos += data.numel()
                writer.submit(slot, param_writes(pub, rank, name, entries))
            report = writer.finish()
            assert report.ok
    finally:
        writer.close()
        transport.close()
        buffers.close()


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def dense_engine(request, configs):
    engine = start_engine(configs["qwen3"], "tp=2", transport=request.param, name=f"dense-{request.param}")
    yield engine
    engine.close()


def test_each_rank_publishes_one_region_holding_all_its_parameters(dense_engine):
    client = SglangEngine(dense_engine.url)
    peers = set()
    for rank in range(2):
        answer = client.transfer_engine_info(rank)
        pub = EnginePublication.from_json(answer)
        assert pub.rank == rank and pub.transport == dense_engine.transport
        assert (answer.get("transport") == "nixl") == (dense_engine.transport == "nixl")
        addr, length = dense_engine.ready[rank]["region"]  # the one registered allocation of the rank
        assert all(addr <= p.data_ptr and p.data_ptr + p.nbytes <= addr + length for p in pub.params.values())
        assert length < pub.total_bytes + 256 * len(pub.params)  # parameters packed, 256-byte aligned
        assert "model.layers.0.self_attn.qkv_proj.weight" in pub.params
        assert not any(k.startswith("p2pw_") for k in answer)  # the leader's private keys stay private
        peers.add(pub.peer)
    assert len(peers) == 2  # one transport endpoint per rank process
    info = client.server_info()
    assert info["tp_size"] == 2 and info["p2pw_transport"] == dense_engine.transport


def test_written_sglang_bytes_pass_the_equality_check(dense_engine, configs):
    write_update(dense_engine, configs["qwen3"], seed=11)
    result = check_weights_equal(dense_engine.url, hf_seed=11)
    assert result["success"], result["message"]
    assert [r["rank"] for r in result["ranks"]] == [0, 1]
    assert all(r["equal"] and r["compared"] > 10 for r in result["ranks"])
    assert SglangEngine(dense_engine.url).weight_version() == "seed11"
    # the same bytes compared with another seed's checkpoint differ everywhere
    other = check_weights_equal(dense_engine.url, hf_seed=12)
    assert not other["success"] and "rank 0" in other["message"] and "rank 1" in other["message"]


def test_a_corrupted_byte_fails_the_check_naming_the_parameter_and_rank(dense_engine, configs):
    write_update(dense_engine, configs["qwen3"], seed=11, corrupt=(1, "model.layers.1.mlp.down_proj.weight", 5))
    result = check_weights_equal(dense_engine.url, hf_seed=11)
    assert not result["success"]
    assert result["mismatches"] == [
        "rank 1: model.layers.1.mlp.down_proj.weight: 1 of 6144 bytes differ (first at byte 5)"]
    assert "rank 1: model.layers.1.mlp.down_proj.weight" in result["message"]
    # sglang's client sees a failed check as HTTP 400 with the same message
    with pytest.raises(EngineError, match="rank 1: model.layers.1.mlp.down_proj.weight"):
        SglangEngine(dense_engine.url).weights_checker(action="p2pw_compare", hf_seed=11)
    write_update(dense_engine, configs["qwen3"], seed=11)
    assert check_weights_equal(dense_engine.url, hf_seed=11)["success"]


@pytest.mark.parametrize("model,layout", [("qwen3_moe", "tp=2,ep=2"), ("deepseek_v3", "tp=2")])
def test_moe_and_mla_engines_pass_the_check_derived_weights_included(configs, model, layout):
    engine = start_engine(configs[model], layout, transport="mooncake", name=model)
    try:
        pub = EnginePublication.from_json(SglangEngine(engine.url).transfer_engine_info(1))
        if model == "qwen3_moe":
            assert pub.params["model.layers.0.mlp.experts.w13_weight"].numel == 4 * 2 * 32 * 64  # 4 of 8 experts
        write_update(engine, configs[model], seed=5)
        result = check_weights_equal(engine.url, hf_seed=5)
        assert result["success"], result["message"]
        if model == "deepseek_v3":  # end_weight_update's post_load_weights derived them on every rank
            assert all(r["compared"] > len(pub.params) for r in result["ranks"])  # w_kc, w_vc compared too
    finally:
        engine.close()


def test_a_killed_engine_dies_whole_and_restarts_on_the_same_port(configs):
    engine = start_engine(configs["qwen3"], "tp=2", transport="mooncake", name="faulty")
    try:
        url, old = engine.url, engine.pids
        client = SglangEngine(url, connect_timeout=1)
        client.pause_generation()
        client.begin_weight_update()        # killed in the middle of an update
        engine.kill(rank=0)                 # the leader: the other rank follows it
        deadline = time.monotonic() + 10
        while engine.alive()[1] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(engine.alive().values())
        with pytest.raises(EngineError, match="connection refused"):
            client.health()
        engine.restart()
        assert engine.url == url and set(engine.pids.values()).isdisjoint(old.values())
        write_update(engine, configs["qwen3"], seed=3)
        assert check_weights_equal(url, hf_seed=3)["success"]
        engine.kill(rank=1)                  # a non-leader rank dies: the leader names it
        with pytest.raises(EngineError, match="rank 1"):
            client.pause_generation()
            client.begin_weight_update()
    finally:
        engine.close()


def test_an_engine_whose_picked_port_is_taken_before_it_binds_picks_another(configs, monkeypatch):
    import socket

    from p2pweights.receiver import local

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()  # another process got the port between the pick and the leader's bind
    picks = iter([taken.getsockname()[1]])
    real = local.free_port
    monkeypatch.setattr(local, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
    try:
        engine = start_engine(configs["qwen3"], "tp=1", transport="mooncake", name="port-race")
        try:
            assert engine.port != taken.getsockname()[1]
            assert SglangEngine(engine.url).health()
        finally:
            engine.close()
    finally:
        taken.close()


def test_engines_started_together_pick_another_port_when_one_is_taken_before_it_binds(configs, monkeypatch):
    import socket

    from p2pweights.receiver import local

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([None, taken.getsockname()[1]])  # the second engine's first pick is taken
    real = local.free_port
    monkeypatch.setattr(local, "free_port", lambda host="127.0.0.1": next(picks, None) or real(host))
    try:
        engines = local.start_engines(configs["qwen3"], "tp=1", count=2, transport="mooncake", name_prefix="race-")
        try:
            assert taken.getsockname()[1] not in [e.port for e in engines]
            assert all(SglangEngine(e.url).health() for e in engines)
        finally:
            for e in engines:
                e.close()
    finally:
        taken.close()


def test_the_launcher_forks_every_rank_from_a_single_threaded_process(dense_engine):
    """Forking a process that runs threads can leave a lock held forever in the child: the launcher's
    loop starts no thread, Python or native, before or between its forks."""
    from p2pweights.receiver.launcher import Launcher

    if dense_engine.launch != "fork":
        pytest.skip("P2PW_RECEIVER_LAUNCH=spawn: no launcher")
    launcher = Launcher.current()
    forks = [f for f in launcher.forks if f["pid"] in dense_engine.pids.values()]
    assert len(forks) == 2  # one fork per rank of this engine
    assert all(f["threads"] == 1 for f in forks), forks  # the main thread only
    # nor did a native thread appear since sglang was imported: what is left are the BLAS pools its
    # import made, which shut themselves down at a fork (pthread_atfork) and stay down after it
    assert all(f["os_threads"] <= launcher.ready_event["os_threads"] for f in forks), (forks, launcher.ready_event)


def test_the_rank_process_hands_the_broadcast_receiver_to_the_rank():
    """The broadcast path reaches an engine rank only as a BroadcastReceiver it is given, picked by
    --broadcast-receiver in the rank process (that no other receiver module imports or names the
    baseline is tests/test_structure.py's import rule)."""
    from p2pweights.baseline.broadcast import GroupReceiver
    from p2pweights.receiver import rank_process

    assert rank_process.BROADCAST_RECEIVERS == {"baseline": GroupReceiver, "none": None}


def test_check_layout_and_the_receivers_equality_check_use_one_reference_model(configs, monkeypatch):
    import torch

    from p2pweights.models.engine_layout import EngineLayout
    from p2pweights.replica import check, reference

    with pytest.raises(ImportError):
        import p2pweights.receiver.reference  # noqa: F401 - the receiver's own copy is gone
    built = []
    real = reference.reference_model

    def recording(*args, **kwargs):
        built.append(kwargs.get("post_process", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(reference, "reference_model", recording)
    engine = EngineLayout.parse("tp=2")
    assert check.check_byte_exact(configs["qwen3"], engine, ranks=[1], seed=4).equal       # check-layout's side
    received, _ = reference.ReferenceModel(configs["qwen3"], engine, 1).loaded(4)      # an engine rank's side
    assert built == [False, True]  # both built by the one reference_model; the receiver's post-processed
    # qwen3's post-processing leaves parameters alone: both references hold the same parameter bytes
    loaded = dict(real(configs["qwen3"], engine, 1, seed=4).named_parameters())
    mine = dict(received.named_parameters())
    assert mine.keys() == loaded.keys()
    assert all(torch.equal(reference.tensor_bytes(mine[n]), reference.tensor_bytes(p)) for n, p in loaded.items())
