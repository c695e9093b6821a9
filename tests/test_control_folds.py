"""The fixed control cost of an update on p2pweights receivers (issue 24, item 6), cut without giving
up a guarantee: the owner's pause rides on its begin once the receiver said it may; every rank
acknowledges a session verb in the verb's own round trip (a stopped rank is named within the ping's
time, rank 0 then does not run it, and the stopped rank does not run it when it wakes up); the end
carries the deltas to each rank; sglang's update hooks are skipped only once a whole session proved
them no-ops on the rank's own model, and keep running where they change bytes. Counts and verdicts,
never timings."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest

from conftest import require_sglang
from p2pweights.control import SglangEngine, UpdateSession
from p2pweights.control import protocol as p
from p2pweights.control.folds import PAUSE_IN_BEGIN
from p2pweights.errors import EngineError, InvalidRequest
from p2pweights.receiver import ReceiverHooks, ReceiverServer
from p2pweights.receiver.hooks import LeaderHooks
from p2pweights.receiver.rank_server import RankCall, call_rank
from replica_configs import write_config


class Recording(ReceiverHooks):
    def __init__(self, fail_begin: bool = False):
        self.calls: list[str] = []
        self.fail_begin = fail_begin

    def on_pause(self, mode):
        self.calls.append(f"pause {mode}")

    def on_begin_update(self, selector):
        self.calls.append("begin")
        if self.fail_begin:
            raise RuntimeError("begin failed in the engine (the test)")

    def on_end_update(self):
        self.calls.append("end")

    def on_continue(self, torch_empty_cache):
        self.calls.append("continue")


class Counting(SglangEngine):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.verbs: list[str] = []

    def _json(self, verb, **kw):
        self.verbs.append(verb)
        return super()._json(verb, **kw)


# ---- the owner's pause rides on its begin ----------------------------------------------------------------


def test_a_receiver_that_said_so_is_paused_by_the_begin_of_the_next_update_in_one_call():
    hooks = Recording()
    with ReceiverServer(hooks) as srv:
        client = Counting(srv.url, name="e0")
        with UpdateSession(client, version=1):
            pass
        assert client.verbs[:2] == ["pause_generation", "begin_weight_update"]  # the first: apart
        assert PAUSE_IN_BEGIN.folds(client)
        del client.verbs[:], hooks.calls[:]
        with UpdateSession(client, version=2, pause_mode="retract") as session:
            assert srv.paused and srv.updating  # paused before anything is written
        assert "pause_generation" not in client.verbs and client.verbs[0] == "begin_weight_update"
        assert hooks.calls == ["pause retract", "begin", "end", "continue"]  # the pause ran, first
        assert session.answers["e0"] is not None and session.outcome == {"e0": "updated"}
        assert client.weight_version() == "2" and not srv.paused


def test_a_folded_begin_that_fails_leaves_the_engine_generating_and_the_next_update_pauses_apart():
    hooks = Recording()
    with ReceiverServer(hooks) as srv:
        client = Counting(srv.url, name="e0")
        with UpdateSession(client, version=1):
            pass
        hooks.fail_begin = True
        del hooks.calls[:]
        with pytest.raises(EngineError, match="begin failed in the engine"):
            UpdateSession(client, version=2).open()
        assert hooks.calls == ["pause abort", "begin", "continue"]  # paused by the begin: continued again
        assert not srv.paused and not srv.updating and client.weight_version() == "1"
        assert not PAUSE_IN_BEGIN.folds(client)  # forgotten: the next one pauses apart
        hooks.fail_begin = False
        del client.verbs[:]
        with UpdateSession(client, version=3):
            pass
        assert client.verbs[:2] == ["pause_generation", "begin_weight_update"]


def test_a_server_that_does_not_say_it_paused_is_paused_apart_before_anything_is_written():
    class Forgetful(ReceiverServer):
        """Now behind the URL: a server whose begin neither pauses nor says it did."""

        def control(self, verb, headers, body):
            if verb != "begin_weight_update":
                return super().control(verb, headers, body)
            body = {k: v for k, v in (body or {}).items() if k != p.PAUSE_FIRST}  # the pause key dropped
            status, answer = super().control(verb, headers, body)
            return status, {k: v for k, v in answer.items() if k != p.BEGIN_PAUSES}

    hooks = Recording()
    with Forgetful(hooks) as srv:
        client = Counting(srv.url, name="e0")
        client.pause_generation()  # what a begin needs (a receiver refuses an unpaused begin)
        PAUSE_IN_BEGIN.learn(client, {p.BEGIN_PAUSES: True})  # as if an earlier server had said so
        del client.verbs[:], hooks.calls[:]
        with UpdateSession(client, version=1) as session:
            assert client.verbs[-1] == "pause_generation"  # paused apart, right after the begin
        assert session.outcome == {"e0": "updated"} and not PAUSE_IN_BEGIN.folds(client)


def test_a_pause_in_a_begin_body_is_checked_before_anything_runs():
    hooks = Recording()
    with ReceiverServer(hooks) as srv:
        client = SglangEngine(srv.url, name="e0")
        client.begin_extra = {p.PAUSE_FIRST: {"mode": "nap"}}
        with pytest.raises(InvalidRequest, match="(?s)HTTP 400.*'mode' must be one of"):
            client.begin_weight_update()
        assert hooks.calls == [] and not srv.paused


# ---- every rank acknowledges a session verb in its own round trip ------------------------------------------

_FAKE_RANK = textwrap.dedent("""
    import sys
    from p2pweights.receiver.rank_server import serve_rank_control

    class FakeRank:
        rank = 1
        calls = []

        def call(self, verb, body):
            if verb == "calls":
                return list(self.calls)
            self.calls.append(verb)
            return {"verb": verb, "body": body}

    httpd = serve_rank_control(FakeRank(), "127.0.0.1", 0)
    print(httpd.server_address[1], flush=True)
    sys.stdin.read()
""")


@pytest.fixture
def fake_rank():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(sys.modules["p2pweights"].__file__)))), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _FAKE_RANK], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=env, text=True)
    port = int(proc.stdout.readline())
    yield proc, f"http://127.0.0.1:{port}"
    os.kill(proc.pid, signal.SIGCONT)
    proc.kill()
    proc.wait()


def _leader(url: str, local_calls: list):
    local = SimpleNamespace(engine=SimpleNamespace(world_size=2), name="e0",
                            call=lambda verb, body: local_calls.append((verb, body)) or {"rank": 0})
    hooks = LeaderHooks(local, "instance")
    hooks.rank_urls[1] = url
    return hooks


def test_a_stopped_rank_is_named_within_the_acknowledgement_and_no_rank_runs_the_verb(fake_rank):
    proc, url = fake_rank
    local_calls: list = []
    hooks = _leader(url, local_calls)
    hooks.on_begin_update("all")  # alive: one round trip, both ranks ran it
    assert local_calls == [("begin", {"selector": "all"})]
    assert call_rank(url, 1, "calls", {}) == ["begin"]
    os.kill(proc.pid, signal.SIGSTOP)
    try:  # (without the acknowledgement the call would wait for the rank's answer: minutes)
        with pytest.raises(EngineError, match="rank 1 .*does not answer") as info:
            hooks.on_all("end", {}, acknowledged_within=0.5)
        assert info.value.rank == 1
        assert local_calls == [("begin", {"selector": "all"})]  # rank 0 did not run it either
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    time.sleep(0.5)  # the rank reads the given-up call now: its caller is gone, so it does not run it
    assert call_rank(url, 1, "calls", {}) == ["begin"]


def test_a_rank_call_that_is_acknowledged_keeps_waiting_for_its_answer(fake_rank):
    _, url = fake_rank
    call = RankCall(url, 1, "end", {"manifests": {"1": {}}}, acknowledge=True)
    assert call.acknowledged(5.0)
    assert call.result() == {"verb": "end", "body": {"manifests": {"1": {}}}}


# ---- sglang's update hooks: skipped only once proven no-ops -------------------------------------------------


def _placed(name: str, tmp_path):
    require_sglang()
    from p2pweights.models.engine_layout import EngineLayout
    from p2pweights.receiver.region import place_parameters
    from p2pweights.replica import sglang_env

    sglang_env.prepare()
    model = sglang_env.build_model(write_config(name, str(tmp_path)), EngineLayout.parse("tp=2"), 0, device="meta")
    place_parameters(model)
    return model


def test_hooks_that_change_nothing_are_skipped_after_one_proving_session(tmp_path):
    from p2pweights.receiver.update_hooks import NO_OP, UNPROVEN, UpdateHooks

    model = _placed("qwen3", tmp_path)
    hooks = UpdateHooks([model], "cpu")
    assert (hooks.begin(), hooks.end(loader_ran=False)) == (False, False)  # run, traced
    assert hooks.verdict == NO_OP
    assert (hooks.begin(), hooks.end(loader_ran=False)) == (True, True)  # skipped from now on
    hooks.begin()
    assert hooks.end(loader_ran=True) is False and hooks.verdict == UNPROVEN  # a loader ran: proven again


def test_hooks_that_derive_buffers_keep_running(tmp_path):
    import torch

    from p2pweights.receiver.update_hooks import CHANGES, UpdateHooks

    model = _placed("deepseek_v3", tmp_path)  # post_load_weights derives w_kc / w_vc from kv_b_proj
    hooks = UpdateHooks([model], "cpu")
    for _ in range(2):
        assert hooks.begin() is False
        attn = model.model.layers[0].self_attn
        with torch.no_grad():
            attn.kv_b_proj.weight.normal_()  # what a session's writes do
        assert hooks.end(loader_ran=False) is False
        assert hooks.verdict == CHANGES and "tensor operation" in hooks.why
        assert attn.w_kc.abs().sum() > 0  # derived from what was written: the hooks ran


def test_a_hook_that_only_sets_an_attribute_refutes_the_proof(tmp_path):
    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    from p2pweights.receiver.update_hooks import CHANGES, UpdateHooks

    model = _placed("qwen3", tmp_path)

    class Packing(UnquantizedLinearMethod):
        """Restore looks at a flag post-processing sets (no tensor operation either way)."""

        def process_weights_after_loading(self, layer):
            layer.packed_once = True

    proj = model.model.layers[0].self_attn.o_proj
    proj.quant_method = Packing()
    hooks = UpdateHooks([model], "cpu")
    hooks.begin()
    hooks.end(loader_ran=False)
    assert hooks.verdict == CHANGES and "packed_once" in hooks.why
    assert (hooks.begin(), hooks.end(loader_ran=False)) == (False, False)  # never skipped
