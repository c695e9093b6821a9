"""``POST /p2pw_weights_digest`` (``update(verify=True)``) served by a REAL sglang 0.5.23 server with the
plugin (``python -m sglang.launch_server``, a tiny Qwen3 on the CPU through the ``p2pw_cpu`` platform):
each rank's scheduler digests what it holds with the receiver's own function
(``control.weights_digest``), reached through sglang's weight-checker path (sglang_plugin/digest.py).

The expected digests are computed here, independently of the server: the receiver's function over
what sglang's own loader makes of the same HF tensors in this process (``replica.reference``). The
weights get into the server two ways: sglang's own ``/update_weights_from_disk`` (a safetensors
checkpoint), and a p2pweights sender's one-sided writes over Mooncake (the server publishes its
weights with sglang's ``--remote-instance-weight-loader-start-seed-via-transfer-engine``). A byte is
flipped in the server's memory through Mooncake, as any process that reaches the rank could.
"""
from __future__ import annotations

import json
import secrets
import shutil
import time
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import require_sglang
from replica_configs import write_config
from sglang_server import free_port, start_sglang_server

require_sglang()  # skips without sglang; fails in CI

import torch  # noqa: E402

from p2pweights.control import SglangEngine, http  # noqa: E402
from p2pweights.control import protocol as p  # noqa: E402
from p2pweights.control.error_answers import error_payload  # noqa: E402
from p2pweights.control.weights_digest import ALGORITHM, digest, parameter_digests  # noqa: E402
from p2pweights.errors import UnknownParameter, UpdateFailed  # noqa: E402
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint  # noqa: E402
from p2pweights.models.engine_layout import EngineLayout  # noqa: E402
from p2pweights.replica.reference import reference_model  # noqa: E402
from p2pweights.sender import WeightSender, verify  # noqa: E402
from p2pweights.sender import verify as update_module  # noqa: E402  # verify_update calls verify_written
from p2pweights.sglang_plugin import digest as plugin_digest  # noqa: E402
from p2pweights.transport.publication import EnginePublication  # noqa: E402

STARTUP_TIMEOUT_S = 900.0  # a shared 2-core host under other suites' load took 220 s for tp=1
# sglang's Mooncake defaults to RDMA and to this host's outward address: TCP on loopback instead
MOONCAKE_ENV = {"MOONCAKE_PROTOCOL": "tcp", "SGLANG_HOST_IP": "127.0.0.1"}
FLIPPED = "model.layers.1.mlp.down_proj.weight"


def start(root, name: str, tp: int = 1, **config: object):
    """A real server publishing its weights over Mooncake, on a bootstrap port of its own; ``config``
    overrides fields of the tiny Qwen3's config.json."""
    model_dir = write_config("qwen3", str(root))
    if config:
        with open(f"{model_dir}/config.json") as f:
            fields = json.load(f)
        with open(f"{model_dir}/config.json", "w") as f:
            json.dump({**fields, **config}, f)
    server = start_sglang_server(model_dir, str(root / f"{name}.log"), tp=tp, env=MOONCAKE_ENV,
                                 extra_args=(p.SEED_FLAG, "--engine-info-bootstrap-port", str(free_port())))
    return server, model_dir


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    server, model_dir = start(tmp_path_factory.mktemp("sglang_digest"), "server")
    try:
        server.wait_healthy(timeout=STARTUP_TIMEOUT_S)
        yield SimpleNamespace(server=server, model_dir=model_dir, engine=SglangEngine(server.url, name="sglang-0",
                                                                                     timeout=120))
    finally:
        server.stop()


def ask(server, names: dict) -> tuple[int, dict]:
    return http.request("POST", server.url, plugin_digest.PATH, body={"names": names}, timeout=120)


def held(server, rank: int, names) -> dict[str, str]:
    status, answer = ask(server, {str(rank): sorted(names)})
    assert status == p.OK and answer["success"] is True and answer["algorithm"] == ALGORITHM, answer
    return answer["ranks"][str(rank)]


def expected(model_dir: str, seed: int, layout: str = "tp=1", rank: int = 0) -> dict[str, str]:
    """The receiver's digest of each parameter after sglang's own loader took ``random_checkpoint(.., seed)``
    and an update session's post-processing ran, in this process."""
    model = reference_model(model_dir, EngineLayout.parse(layout), rank, seed=seed, post_process=True)
    return {name: digest(param) for name, param in model.named_parameters()}


def load_from_disk(server, model_dir: str, seed: int, folder) -> None:
    """sglang's own ``/update_weights_from_disk`` with a safetensors checkpoint of the seed."""
    from safetensors.torch import save_file

    folder.mkdir()
    shutil.copy(f"{model_dir}/config.json", folder / "config.json")
    save_file({n: t.contiguous() for n, t in random_checkpoint(checkpoint_tensors(model_dir), seed)},
              str(folder / "model.safetensors"))
    status, answer = http.request("POST", server.url, "/update_weights_from_disk",
                                  body={"model_path": str(folder), "load_format": "auto"}, timeout=300)
    assert status == p.OK and answer["success"] is True, answer


def flip_one_byte(engine: SglangEngine, rank: int, param: str) -> None:
    """Flip the first byte of ``param`` in engine rank ``rank``'s memory, through Mooncake."""
    from p2pweights.transport.mooncake import new_engine

    pub = EnginePublication.from_json(engine.transfer_engine_info(rank))
    te, _ = new_engine("127.0.0.1")
    buf = np.zeros(64, dtype=np.uint8)
    assert te.register_memory(buf.ctypes.data, buf.nbytes, "*") == 0
    try:
        addr = pub.params[param].data_ptr
        assert te.transfer_sync_read(pub.peer, buf.ctypes.data, addr, 1) == 0
        buf[0] ^= 0x10
        assert te.transfer_sync_write(pub.peer, buf.ctypes.data, addr, 1) == 0
    finally:
        te.unregister_memory(buf.ctypes.data)


# -- a real tp=1 server -----------------------------------------------------------------------------
def test_the_plugin_offers_the_digest_and_the_sender_then_needs_no_probe(seeded, monkeypatch):
    info = seeded.engine.server_info()
    assert p.PLUGIN_DIGEST in info["p2pw_plugin"]["offers"] and "error" not in info["p2pw_plugin"], info["p2pw_plugin"]
    assert p.PLUGIN_DIGEST in seeded.engine.plugin_offers
    probes = []
    monkeypatch.setattr(verify, "_ask", lambda engine, names: probes.append(engine.name) or {})
    verify.check_engines_digest([seeded.engine])
    assert probes == []  # offered: not asked
    unread = SglangEngine(seeded.server.url, name="unread")  # has not read /server_info: asked
    verify.check_engines_digest([unread])
    assert probes == ["unread"]
    monkeypatch.undo()
    verify.check_engines_digest([unread])  # and the real route answers the empty ask


def test_the_digests_are_the_receivers_function_over_what_sglangs_own_loader_wrote(seeded, tmp_path):
    want = expected(seeded.model_dir, 5)
    before = held(seeded.server, 0, want)  # sglang's dummy weights: the check can fail
    assert before.keys() == want.keys() and all(before[n] != want[n] for n in want)
    load_from_disk(seeded.server, seeded.model_dir, 5, tmp_path / "seed5")
    status, answer = ask(seeded.server, {"0": sorted(want)})
    assert (status, answer) == (p.OK, {"success": True, "algorithm": ALGORITHM, "ranks": {"0": want}})
    assert held(seeded.server, 0, ["model.norm.weight"]) == {"model.norm.weight": want["model.norm.weight"]}


def test_one_flipped_byte_changes_that_parameters_digest_and_no_other(seeded):
    names = expected(seeded.model_dir, 5).keys()
    before = held(seeded.server, 0, names)
    flip_one_byte(seeded.engine, 0, FLIPPED)
    after = held(seeded.server, 0, names)
    flip_one_byte(seeded.engine, 0, FLIPPED)  # back
    assert [n for n in names if after[n] != before[n]] == [FLIPPED]
    assert held(seeded.server, 0, names) == before


def test_verify_catches_a_flipped_byte_naming_rank_and_parameter_and_the_next_update_heals(seeded, monkeypatch):
    specs = checkpoint_tensors(seeded.model_dir)
    real_verify = update_module.verify_written

    def corrupt_then_verify(*args, **kwargs):  # after every write returned, before the digests
        flip_one_byte(seeded.engine, 0, FLIPPED)
        return real_verify(*args, **kwargs)

    def push(version: str, seed: int):
        with sender.update(version, verify=True) as u:
            for name, t in random_checkpoint(specs, seed):
                u.push(name, t)
        return u

    sender = WeightSender(seeded.model_dir, transport="mooncake", buffer_size=1 << 20)
    try:
        sender.connect([seeded.engine])
        assert push("v1", 1).verify_seconds > 0
        assert seeded.engine.weight_version() == "v1"
        want1 = expected(seeded.model_dir, 1)
        assert held(seeded.server, 0, want1) == want1

        monkeypatch.setattr(update_module, "verify_written", corrupt_then_verify)
        with pytest.raises(UpdateFailed) as info:
            push("v2", 2)
        e = info.value
        assert (e.engine, e.rank, e.parameter) == ("sglang-0", 0, FLIPPED) and list(e.failures) == ["sglang-0/rank0"]
        assert "1 of" in str(e)
        # not resumed: the old version, the sender's session still open (nothing ended it)
        assert seeded.engine.weight_version() == "v1"
        assert seeded.server.get_json("/server_info")["p2pw_weight_update"]["state"] in ("open", p.TORN)

        monkeypatch.setattr(update_module, "verify_written", real_verify)
        push("v3", 3)  # the next complete, verified update heals the engine
        assert seeded.engine.weight_version() == "v3"
        assert held(seeded.server, 0, expected(seeded.model_dir, 3)) == expected(seeded.model_dir, 3)
    finally:
        sender.close()


def test_an_unknown_parameter_is_the_receivers_400_naming_rank_and_parameter(seeded):
    status, answer = ask(seeded.server, {"0": ["model.norm.weight", "no.such.param"]})
    with pytest.raises(UnknownParameter) as info:  # what a receiver's rank raises, and answers
        parameter_digests(torch.nn.Module(), ["no.such.param"], engine=seeded.server.url, rank=0)
    assert (status, answer) == (p.BAD_REQUEST, error_payload(info.value))
    assert answer["error"]["rank"] == 0 and answer["error"]["parameter"] == "no.such.param"


@pytest.mark.parametrize("names,field", [([1, 2], "names"), ({"0": [1]}, "names"), ({"0": "weight"}, "names"),
                                         ({"x": ["model.norm.weight"]}, "names")])
def test_a_malformed_body_is_a_400_naming_the_field(seeded, names, field):
    status, answer = ask(seeded.server, names)
    assert status == p.BAD_REQUEST and field in answer["message"] and answer["error"]["type"] == "InvalidRequest", answer


def test_sglangs_own_weight_checker_is_unchanged(seeded):
    status, answer = http.request("POST", seeded.server.url, "/weights_checker", body={"action": "checksum"},
                                  timeout=120)
    assert status == p.OK and answer["success"] is True, answer
    assert len(answer["ranks"]) == 1 and "model.norm.weight" in answer["ranks"][0]["checksums"]
    assert answer["ranks"][0]["checksums"]["model.norm.weight"] != held(seeded.server, 0, ["model.norm.weight"])[
        "model.norm.weight"]  # sglang's hash, not the digest


# -- a real tp=2 server -----------------------------------------------------------------------------
def test_a_tp2_server_answers_every_ranks_digest_and_names_the_rank_that_differs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_digest_tp2")
    # sglang on the CPU pads an intermediate size that tp * 32 does not divide (96 -> 128 at tp=2:
    # adjust_config_with_unaligned_cpu_tp), a layout the reference (a GPU rank's) does not have
    server, model_dir = start(root, "tp2", tp=2, intermediate_size=128)
    try:
        server.wait_healthy(timeout=STARTUP_TIMEOUT_S)
        engine = SglangEngine(server.url, name="tp2", timeout=120)
        load_from_disk(server, model_dir, 7, root / "seed7")
        want = {r: expected(model_dir, 7, "tp=2", r) for r in (0, 1)}
        status, answer = ask(server, {str(r): sorted(w) for r, w in want.items()})
        assert status == p.OK and sorted(answer["ranks"]) == ["0", "1"], answer
        differ = {r: [n for n in w if answer["ranks"][str(r)].get(n) != w[n]] for r, w in want.items()}
        assert differ == {0: [], 1: []}
        assert answer == {"success": True, "algorithm": ALGORITHM, "ranks": {str(r): w for r, w in want.items()}}
        assert ask(server, {"1": ["model.norm.weight"]})[1]["ranks"] == {
            "0": {}, "1": {"model.norm.weight": want[1]["model.norm.weight"]}}  # a rank not asked answers {}

        flip_one_byte(engine, 1, FLIPPED)
        got = ask(server, {str(r): sorted(w) for r, w in want.items()})[1]["ranks"]
        assert got["0"] == want[0]
        assert [n for n in want[1] if got["1"][n] != want[1][n]] == [FLIPPED]

        status, answer = ask(server, {"0": ["model.norm.weight"], "1": ["no.such.param"]})
        assert status == p.BAD_REQUEST and answer["error"]["rank"] == 1, answer  # every rank still answered
        assert held(server, 0, ["model.norm.weight"]) == {"model.norm.weight": want[0]["model.norm.weight"]}

        # a takeover of a lapsed session revokes both ranks (their all-gathered answer) under epoch 2
        before = {r: EnginePublication.from_json(engine.transfer_engine_info(r)) for r in (0, 1)}
        assert {pub.epoch for pub in before.values()} == {1}
        lost, taker = (SglangEngine(server.url, name=n, timeout=120) for n in ("lost", "taker"))
        for e in (lost, taker):
            e.session_owner, e.session_label = secrets.token_urlsafe(32), f"test:{e.name}"
        lost.pause_generation()
        lost.begin_weight_update(lease=1.0)
        time.sleep(2.5)  # the owner stays silent past its lease: torn
        taken = taker.begin_weight_update()
        assert taken["took_over"] is True and taken["epoch"] == 2, taken
        after = {r: EnginePublication.from_json(engine.transfer_engine_info(r)) for r in (0, 1)}
        assert {pub.epoch for pub in after.values()} == {2}
        assert all(after[r].peer != before[r].peer and after[r].params == before[r].params for r in (0, 1))
        assert taker.end_weight_update()["success"] is True
        taker.continue_generation()
    finally:
        server.stop()


# -- in this process --------------------------------------------------------------------------------
def tiny(**shapes) -> torch.nn.Module:
    model = torch.nn.Module()
    for i, (name, shape) in enumerate(shapes.items()):
        setattr(model, name, torch.nn.Parameter(torch.arange(np.prod(shape), dtype=torch.float32).reshape(shape) + i))
    return model


def test_rank_digests_follow_the_receivers_rules_for_target_and_draft_names():
    target, draft = tiny(a=(3, 5), b=(7,)), tiny(a=(2,), c=(4, 4))
    got = plugin_digest.rank_digests(target, draft, ["a", "draft.a", "draft.c"], engine="e", rank=1)
    assert got == {"a": digest(target.a), "draft.a": digest(draft.a), "draft.c": digest(draft.c)}
    with pytest.raises(UnknownParameter) as info:
        plugin_digest.rank_digests(target, None, ["a", "draft.c"], engine="e", rank=1)
    assert (info.value.rank, info.value.parameter) == (1, "draft.c")
    with pytest.raises(UnknownParameter):
        plugin_digest.rank_digests(target, draft, ["b", "draft.b"], engine="e", rank=1)


def test_the_hook_answers_its_action_and_leaves_every_other_one_to_sglang(monkeypatch):
    from p2pweights.replica import sglang_env

    sglang_env.prepare()  # sglang's io_struct imports torchvision: under the replica's stub here
    import sglang.srt.runtime_context as runtime_context
    from sglang.srt.managers.io_struct import CheckWeightsReqInput, CheckWeightsReqOutput

    parallel = SimpleNamespace(tp_rank=0, tp_size=1, dp_rank=None, attn_dp_size=1, pp_rank=0, pp_size=1)
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: parallel)
    model = tiny(w=(4, 3))
    manager = SimpleNamespace(tp_worker=SimpleNamespace(weight_update_runners=lambda: [("target", SimpleNamespace(
        model=model))]), draft_worker=None, tp_cpu_group=None)
    sglangs = CheckWeightsReqOutput(success=True, message="sglang's")
    other = CheckWeightsReqInput(action="checksum")
    assert plugin_digest.around_check_weights(lambda m, r: sglangs if (m, r) == (manager, other) else None,
                                              manager, other) is sglangs

    out = plugin_digest.around_check_weights(pytest.fail, manager, plugin_digest.check_request({0: ["w"]}, "e"))
    assert out.success and out.payload[0].checksums == {"w": digest(model.w)}
    assert plugin_digest.answer_of([out]) == (p.OK, {"success": True, "algorithm": ALGORITHM,
                                                     "ranks": {"0": {"w": digest(model.w)}}})

    out = plugin_digest.around_check_weights(pytest.fail, manager, plugin_digest.check_request({0: ["x"]}, "e"))
    status, answer = plugin_digest.answer_of([out])
    assert not out.success and status == p.BAD_REQUEST and answer["error"]["type"] == "UnknownParameter"
    assert (answer["error"]["rank"], answer["error"]["parameter"], answer["error"]["engine"]) == (0, "x", "e")

    # a scheduler without the hook: sglang's weight checker refuses the action; no digest, as a receiver without it
    status, answer = plugin_digest.answer_of([CheckWeightsReqOutput(success=False, message="Unsupported action='x'")])
    assert status == p.NOT_IMPLEMENTED and "does not digest" in answer["message"]
    assert json.loads(json.dumps(answer)) == answer


def test_the_route_is_read_only_and_keyed_as_sglangs_weight_checker():
    from p2pweights.replica import sglang_env

    sglang_env.prepare()
    from sglang.srt.utils.auth import AuthLevel

    from p2pweights.sglang_plugin import sessions

    assert plugin_digest.PATH not in sessions.GATED_PATHS  # reading: anyone's, as on a receiver
    assert plugin_digest.endpoint(object(), "e")._auth_level == AuthLevel.ADMIN_OPTIONAL
