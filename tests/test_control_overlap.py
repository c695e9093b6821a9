"""The control plane of a steady-state update, made cheap without giving up an invariant: kept-alive
connections, the sessions opened beside the first slots (the first write waits for them), the last
check-in beside the last writes, and a receiver's end that bumps the version and continues in the
same call (sglang's servers keep getting three). Real receiver processes over Mooncake; counts,
never timings."""
from __future__ import annotations

import json
import time

import pytest

from engine_proxy import PosingAs
from p2pweights.control import SglangEngine, UpdateSession
from p2pweights.control import http as control_http
from p2pweights.control import protocol as p
from p2pweights.control.update_session import FAILED, LEFT_PAUSED, UPDATED
from p2pweights.errors import EngineError
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
from p2pweights.receiver import ReceiverHooks, ReceiverServer, check_weights_equal, start_engines
from p2pweights.sender import WeightSender
from p2pweights.sender.update import ROLLED_BACK, UNTOUCHED
from replica_configs import write_config


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_config("qwen3", str(tmp_path_factory.mktemp("configs")))


@pytest.fixture(scope="module")
def engine(model):
    (e,) = start_engines(model, "tp=2", count=1, transport="mooncake", name_prefix="overlap")
    yield e
    e.close()


class Counting(SglangEngine):
    """An engine client that counts its calls by verb."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.calls: list[str] = []

    def _json(self, verb, **kw):
        self.calls.append(verb)
        return super()._json(verb, **kw)


def _push(sender, version, seed, specs):
    with sender.update(version) as update:
        for name, t in random_checkpoint(specs, seed):
            update.push(name, t)
    return update


# ---- kept-alive connections -----------------------------------------------------------------------------


@pytest.mark.parametrize("open_beside", ["0", "1"])
def test_a_steady_state_update_opens_no_connection(model, engine, monkeypatch, open_beside):
    monkeypatch.setattr(control_http.POOL, "idle_reuse_s", 600.0)  # reuse, whatever this machine's load
    monkeypatch.setenv("P2PW_OPEN_BESIDE_SLOTS", open_beside)
    specs = checkpoint_tensors(model)
    client = Counting(engine.url, name=engine.name)
    with WeightSender(model, transport="mooncake", buffer_size=1 << 20) as sender:
        sender.connect([client])
        _push(sender, "c1", 1, specs)
        opened, calls = control_http.POOL.connects, len(client.calls)
        _push(sender, "c2", 2, specs)
        assert len(client.calls) - calls >= 4  # version check, pause, begin, check-in, end
        assert control_http.POOL.connects == opened  # every one of them on a kept connection
    assert check_weights_equal(engine.url, hf_seed=2)["success"]


def test_a_kept_connection_the_server_closed_is_not_reused_and_never_reaches_the_closed_server():
    first = ReceiverServer().start()
    client = SglangEngine(first.url, name="e0")
    client.pause_generation()  # a kept connection to the first server
    assert first.paused
    port = first.port
    first.close()
    second = ReceiverServer(port=port).start()
    try:
        opened = control_http.POOL.connects
        client.pause_generation()  # a POST: never repeated, so the stale connection must not be tried
        assert second.paused and control_http.POOL.connects == opened + 1
        client.continue_generation()
        assert not second.paused and control_http.POOL.connects == opened + 1  # kept again
    finally:
        second.close()


# ---- the sessions open beside the first slots -------------------------------------------------------------


class _Posing(PosingAs):
    """The real engine's info and publications; its begin waits until the sender holds a slot for
    the first write, looks at the real engine's weights then, and succeeds or fails."""

    def __init__(self, real: str, sender_of, previous_seed: int, fail: bool):
        super().__init__(real)
        self.sender_of, self.previous_seed, self.fail = sender_of, previous_seed, fail
        self.held = self.unchanged_while_held = None

    def transfer_engine_info(self, rank: int):
        return self.real.transfer_engine_info(rank)["remote_instance_transfer_engine_info"]

    def on_begin_update(self, selector: str) -> None:
        gate = self.sender_of()._update._gate
        deadline = time.monotonic() + 30
        while gate.holding == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        self.held = gate.holding
        if self.previous_seed is not None:
            self.unchanged_while_held = check_weights_equal(self.real.base_url,
                                                            hf_seed=self.previous_seed)["success"]
        if self.fail:
            raise RuntimeError("begin refused by the test")


@pytest.fixture
def beside(monkeypatch):
    monkeypatch.setenv("P2PW_OPEN_BESIDE_SLOTS", "1")


@pytest.mark.parametrize("fail", [False, True], ids=["opens", "fails"])
def test_slots_are_produced_while_the_sessions_open_and_nothing_is_written_before(model, engine, fail, beside):
    specs = checkpoint_tensors(model)
    sender = WeightSender(model, transport="mooncake", buffer_size=1 << 20)
    hooks = _Posing(engine.url, lambda: sender, previous_seed=None, fail=False)
    server = ReceiverServer(hooks).start()
    try:
        sender.connect([SglangEngine(server.url, name="posing")])
        _push(sender, "s11", 11, specs)  # the engine holds seed 11
        assert hooks.held == 1
        hooks.fail, hooks.previous_seed = fail, 11
        hooks.held = hooks.unchanged_while_held = None
        if not fail:
            update = _push(sender, "s12", 12, specs)
            assert hooks.held == 1 and hooks.unchanged_while_held  # the slot waited for the open session
            assert update._gate.submitted >= 1 and update._gate.dropped == 0
            assert check_weights_equal(engine.url, hf_seed=12)["success"]
            return
        with pytest.raises(EngineError, match=r"(?s)posing.*begin refused by the test") as info:
            _push(sender, "s12", 12, specs)
        update = sender._update
        assert hooks.held == 1 and hooks.unchanged_while_held
        assert update._gate.submitted == 0 and update._gate.dropped >= 1  # produced, never written
        assert update.outcome == UNTOUCHED and info.value.engine == "posing"
        assert check_weights_equal(engine.url, hf_seed=11)["success"]  # every byte as before
        assert not server.paused and not server.updating and server.weight_version == "s11"
        hooks.fail, hooks.previous_seed = False, None
        _push(sender, "s13", 13, specs)  # every slot was released: the next update runs
        assert check_weights_equal(engine.url, hf_seed=13)["success"] and server.weight_version == "s13"
    finally:
        sender.close()
        server.close()


def test_the_trainer_failing_while_the_sessions_open_rolls_them_back_with_nothing_written(model, engine, beside):
    specs = checkpoint_tensors(model)
    sender = WeightSender(model, transport="mooncake", buffer_size=1 << 20)
    server = ReceiverServer(_Passing(engine.url)).start()
    try:
        sender.connect([SglangEngine(server.url, name="posing")])
        _push(sender, "t21", 21, specs)
        items = list(random_checkpoint(specs, 22))
        with pytest.raises(ValueError, match="the trainer's own error"):
            with sender.update("t22") as update:
                update.push(*items[0])  # paused; the sessions open on a thread from here
                assert server.paused  # the first good push returns with the engines paused
                raise ValueError("the trainer's own error")
        assert update.outcome == ROLLED_BACK
        assert not server.paused and not server.updating and server.weight_version == "t21"
        assert check_weights_equal(engine.url, hf_seed=21)["success"]
    finally:
        sender.close()
        server.close()


class _Passing(PosingAs):
    def transfer_engine_info(self, rank: int):
        return self.real.transfer_engine_info(rank)["remote_instance_transfer_engine_info"]


# ---- the last check-in beside the last writes ----------------------------------------------------------


class _Hooks(ReceiverHooks):
    def __init__(self):
        self.renewals = self.versions = self.continues = 0
        self.fail_renew = self.fail_version = False

    def on_renew_lease(self):
        self.renewals += 1
        if self.fail_renew:
            raise EngineError("rank 1 does not answer (the test)", rank=1)

    def on_weight_version(self, new_version, abort_all_requests):
        self.versions += 1
        if self.fail_version:
            raise RuntimeError("the version hook failed (the test)")

    def on_continue(self, torch_empty_cache):
        self.continues += 1


@pytest.fixture
def receivers():
    servers = [ReceiverServer(_Hooks()).start() for _ in range(2)]
    yield servers
    for s in servers:
        s.close()


def test_commit_takes_the_early_check_in_verdict_and_leaves_a_stalled_engine_paused(receivers):
    good, stalled = receivers
    stalled.hooks.fail_renew = True
    session = UpdateSession([Counting(good.url, name="good"), Counting(stalled.url, name="stalled")], "v1")
    session.open()
    session.check_in_soon()
    with pytest.raises(EngineError, match="(?s)stalled.*rank 1 does not answer"):
        session.commit()
    assert good.hooks.renewals == 1 and stalled.hooks.renewals == 1  # commit did not check in again
    assert session.outcome == {"good": UPDATED, "stalled": LEFT_PAUSED}
    assert good.weight_version == "v1" and not good.paused
    assert stalled.updating and stalled.paused and stalled.weight_version == "default"


# ---- a receiver's end bumps the version and continues in the same call ----------------------------------


def test_a_receiver_ends_bumps_and_continues_in_one_call(receivers):
    server = receivers[0]
    client = Counting(server.url, name="e0")
    session = UpdateSession([client], "v7")
    session.open()
    session.commit()
    assert client.calls.count("end_weight_update") == 1
    assert "update_weight_version" not in client.calls and "continue_generation" not in client.calls
    assert server.hooks.versions == 1 and server.hooks.continues == 1
    assert server.weight_version == "v7" and not server.paused and not server.updating
    assert session.outcome == {"e0": UPDATED}
    assert server.session.state()["state"] == "none"


def test_an_sglang_server_gets_end_version_and_continue_as_three_calls(receivers):
    ends: list[dict] = []

    class SglangLike(ReceiverServer):
        def control(self, verb, headers, body):
            if verb == "end_weight_update":
                ends.append(dict(body or {}))
            status, answer = super().control(verb, headers, body)
            if verb == "begin_weight_update":
                answer.pop(p.END_FOLDS)  # sglang's begin answers only success and message
            return status, answer

    server = SglangLike(_Hooks()).start()
    try:
        client = Counting(server.url, name="sglang")
        session = UpdateSession([client], "v8")
        session.open()
        session.commit()
        assert ends == [{}]  # a plain end: sglang never sees p2pweights' field
        assert [c for c in client.calls if c in ("end_weight_update", "update_weight_version",
                                                 "continue_generation")] == [
            "end_weight_update", "update_weight_version", "continue_generation"]
        assert server.weight_version == "v8" and not server.paused and session.outcome == {"sglang": UPDATED}
    finally:
        server.close()


def test_a_version_that_fails_after_the_folded_end_leaves_that_engine_paused_and_the_other_updated(receivers):
    good, bad = receivers
    bad.hooks.fail_version = True
    session = UpdateSession([SglangEngine(good.url, name="good"), SglangEngine(bad.url, name="bad")], "v9")
    session.open()
    with pytest.raises(EngineError, match=r"(?s)bad.*update_weight_version after end_weight_update failed.*version hook"):
        session.commit()
    assert session.outcome == {"good": UPDATED, "bad": FAILED}
    assert good.weight_version == "v9" and not good.paused
    # ended (its weights are the new ones) but neither bumped nor continued: never generating under a wrong label
    assert not bad.updating and bad.paused and bad.weight_version == "default" and bad.hooks.continues == 0


def test_a_malformed_then_is_refused_before_the_engine_ends(receivers):
    server = receivers[0]
    client = SglangEngine(server.url, name="e0")
    client.pause_generation()
    client.begin_weight_update()
    for then in ({"new_version": 5}, {"new_version": "v1", "continue": "yes"}, "v1"):
        status, answer = control_http.request("POST", server.url, "/end_weight_update",
                                              body={p.END_THEN: then})
        assert status == p.BAD_REQUEST and p.END_THEN in json.dumps(answer)
        assert server.updating and server.weight_version == "default"  # nothing ran
    client.end_weight_update()
    assert not server.updating


def test_the_lease_renewer_forgets_an_engine_once_it_ended(receivers):
    server = receivers[0]
    session = UpdateSession([SglangEngine(server.url, name="e0")], "v10")
    session.open()
    assert set(session._renewer.leased) == {"e0"}
    session.commit()
    assert session._renewer.leased == {}  # a renewal still in flight then finds nothing to renew
