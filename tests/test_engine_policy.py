"""The engine core's rules, held against all three hosts: the same calls, the same answers, faults
included (engine/core.py; the hosts: tests/engine_hosts.py). Each rule here was decided apart by
each host before the core, and several disagreed: the tear after a refused delta apply, whether a
begin needs a paused engine, the epoch a takeover moves to, the key rules of the plugin's own route."""
from __future__ import annotations

import pytest

from conftest import require_sglang
from engine_hosts import PATHS, make, manifest, owner

require_sglang()  # the sglang plugin's gate uses sglang's own key middleware

from p2pweights.control import protocol as p  # noqa: E402
from p2pweights.deltas.committed import BASE_KEY, DELTA_KEY  # noqa: E402


@pytest.fixture(params=["receiver", "sglang", "vllm"])
def host(request, monkeypatch):
    h = make(request.param, monkeypatch)
    try:
        yield h
    finally:
        h.close()


def _error(answer) -> str:
    return str(answer.get("error", {}).get("type") if isinstance(answer, dict) else answer)


def committed(host, who: str) -> dict:
    """A complete update by ``who`` (pause, begin, end): the base the engine answered."""
    assert host.call("pause", {}, who)[0] == p.OK
    status, begun = host.call("begin", {}, who)
    assert status == p.OK, begun
    status, ended = host.call("end", {}, who)
    assert status == p.OK, ended
    return ended[BASE_KEY]


def delta_session(host, who: str) -> None:
    """``who`` commits, then opens a session whose delta claim the engine accepts."""
    base = committed(host, who)
    host.call("pause", {}, who)
    status, begun = host.call("begin", {DELTA_KEY: base}, who)
    assert status == p.OK and begun[DELTA_KEY]["accepted"], begun


def test_a_complete_update_answers_the_lease_the_epoch_and_a_new_base(host):
    who = owner()
    host.call("pause", {}, who)
    status, begun = host.call("begin", {}, who)
    assert status == p.OK and begun["lease"] == 30.0 and begun["epoch"] == 1 and begun["took_over"] is False
    assert host.state()["state"] == "open"
    status, ended = host.call("end", {}, who)
    assert status == p.OK and set(ended[BASE_KEY]) == {"epoch", "token"}
    assert host.state()["state"] == "none"


def test_a_begin_needs_a_paused_engine_and_changes_nothing_otherwise(host):
    status, answer = host.call("begin", {}, owner())
    assert status == p.BAD_REQUEST and "pause_generation" in answer["message"]
    assert host.state()["state"] == "none"


def test_another_controller_is_refused_409_while_the_owners_session_is_live(host):
    first, second = owner(), owner()
    host.call("pause", {}, first)
    assert host.call("begin", {}, first)[0] == p.OK
    for verb in ("continue", "version", "end", "begin", "renew"):
        status, answer = host.call(verb, {"new_version": "x"}, second)
        assert status == p.CONFLICT and _error(answer) == "SessionConflict", (verb, answer)
    assert host.call("end", {}, first)[0] == p.OK


def test_version_and_continue_wait_for_the_end(host):
    who = owner()
    host.call("pause", {}, who)
    host.call("begin", {}, who)
    for verb in ("version", "continue"):
        status, answer = host.call(verb, {"new_version": "v1"}, who)
        assert status == p.BAD_REQUEST and "end_weight_update" in answer["message"], (verb, answer)
    assert host.call("end", {}, who)[0] == p.OK
    assert host.call("version", {"new_version": "v1"}, who)[0] == p.OK
    assert host.call("continue", {}, who)[0] == p.OK


def test_a_refused_delta_apply_at_the_end_tears_the_engine_until_a_complete_update(host):
    who = owner()
    delta_session(host, who)
    host.ranks.fail_apply = True
    status, answer = host.call("end", {DELTA_KEY: {"0": manifest()}}, who)
    assert status == p.ENGINE_FAILED and _error(answer) == "InvalidWrite", answer
    state = host.state()
    assert state["state"] == p.TORN and "partly" in state["torn"]
    status, answer = host.call("continue", {}, who)
    assert status == p.CONFLICT and _error(answer) == "TornWeights"
    # the next complete update heals it, its claim refused (the base was forgotten)
    host.ranks.fail_apply = False
    healer = owner()
    status, begun = host.call("begin", {DELTA_KEY: {"epoch": 1, "token": "0" * 32}}, healer)
    assert status == p.OK and begun["took_over"] and not begun[DELTA_KEY]["accepted"]
    assert host.call("end", {}, healer)[0] == p.OK and host.state()["state"] == "none"


def test_a_refused_apply_inside_the_session_tears_the_engine(host):
    who = owner()
    delta_session(host, who)
    host.ranks.fail_apply = True
    status, answer = host.call("apply", {"manifests": {"0": manifest()}}, who)
    assert status == p.ENGINE_FAILED and _error(answer) == "InvalidWrite", answer
    assert host.state()["state"] == p.TORN


def test_a_malformed_manifest_is_400_changes_nothing_and_the_owner_may_end_again(host):
    who = owner()
    delta_session(host, who)
    for bad in ({"-1": manifest()}, {"zero": manifest()}, {"0": {"bytes": -1}}, ["0"]):
        status, answer = host.call("end", {DELTA_KEY: bad}, who)
        assert status == p.BAD_REQUEST, (bad, answer)
        assert host.state()["state"] == "open" and host.ranks.applied == []
    status, ended = host.call("end", {DELTA_KEY: {"0": manifest()}}, who)
    assert status == p.OK and len(host.ranks.applied) == 1


def test_several_writers_segments_reach_the_ranks_and_overlapping_ones_are_400_before_any_rank(host):
    """PP stages write one rank's area, each its own part: the end names one segment per writer. Every
    host hands the ranks the same ascending segments; segments that overlap (one writer's digest
    would vouch for another's bytes), too many, or out of order are refused before any rank applies."""
    who = owner()
    delta_session(host, who)
    seg = [{**manifest(), "bytes": 64, "records": 1, "offsets": [0]},
           {**manifest(), "start": 4096, "bytes": 64, "records": 1, "offsets": [4096]}]
    overlapping = [seg[0], {**seg[1], "start": 32, "offsets": [32]}]
    for bad in (overlapping, [seg[1], seg[0]], [], [manifest()] * 1025, [{**seg[1], "start": 4100}]):
        status, answer = host.call("end", {DELTA_KEY: {"0": bad}}, who)
        assert status == p.BAD_REQUEST, answer
        assert host.state()["state"] == "open" and host.ranks.applied == []
    status, ended = host.call("end", {DELTA_KEY: {"0": seg}}, who)
    assert status == p.OK and len(host.ranks.applied) == 1, host.ranks.applied
    assert {str(r): m for r, m in host.ranks.applied[0].items()} == {"0": seg}


def test_each_area_byte_is_applied_at_most_once_per_session_the_rest_at_the_end(host):
    """The owner applies segments as its slots' writes return (p2pw_apply_deltas), then ends with the
    rest: every host hands each call's segments to the ranks; a segment overlapping bytes applied
    before in the session (a replay) is 400 before any rank, the session still open; after the end
    the session's deltas are gone."""
    who = owner()
    delta_session(host, who)
    first = {**manifest(), "bytes": 64, "records": 1, "offsets": [0]}
    second = {**manifest(), "start": 64, "bytes": 128, "records": 1, "offsets": [64]}
    assert host.call("apply", {"manifests": {"0": first}}, who)[0] == p.OK
    assert host.call("apply", {"manifests": {"0": [second]}}, who)[0] == p.OK
    for replay in (first, [second], [{**first, "start": 32, "offsets": [32]}], [{**second, "start": 184, "offsets": [184]}]):
        status, answer = host.call("apply", {"manifests": {"0": replay}}, who)
        assert status == p.BAD_REQUEST and "applied already" in answer["message"], (replay, answer)
        status, answer = host.call("end", {DELTA_KEY: {"0": replay}}, who)
        assert status == p.BAD_REQUEST and "applied already" in answer["message"], (replay, answer)
        assert host.state()["state"] == "open" and len(host.ranks.applied) == 2
    rest = {**manifest(), "start": 192, "bytes": 64, "records": 1, "offsets": [192]}
    status, ended = host.call("end", {DELTA_KEY: {"0": [rest]}}, who)
    assert status == p.OK and len(host.ranks.applied) == 3, ended
    assert [{str(r): m for r, m in a.items()} for a in host.ranks.applied] == [
        {"0": first}, {"0": [second]}, {"0": [rest]}]
    status, answer = host.call("apply", {"manifests": {"0": rest}}, who)
    assert status == p.BAD_REQUEST, answer  # no session: nothing more is applied


def test_an_end_after_its_deltas_were_applied_names_none_and_commits(host):
    who = owner()
    delta_session(host, who)
    assert host.call("apply", {"manifests": {"0": manifest()}}, who)[0] == p.OK
    status, ended = host.call("end", {}, who)
    assert status == p.OK and set(ended[BASE_KEY]) == {"epoch", "token"}
    host.call("pause", {}, who)
    status, begun = host.call("begin", {}, who)  # a session whose begin accepted no deltas names none
    assert status == p.OK
    status, answer = host.call("apply", {"manifests": {"0": manifest()}}, who)
    assert status == p.BAD_REQUEST and "did not accept" in answer["message"]


def test_a_takeover_revokes_first_and_a_failed_revocation_fails_the_begin_and_stays_torn(host):
    lost, taker = owner(), owner()
    host.call("pause", {}, lost)
    host.call("begin", {}, lost)
    assert host.call("renew", {"release": True}, lost)[0] == p.OK
    assert host.state()["state"] == p.TORN
    host.ranks.fail_revoke = True
    status, answer = host.call("begin", {}, taker)
    assert status == p.ENGINE_FAILED and "could not revoke" in answer["message"] and host.ranks.epoch == 1
    assert host.state()["state"] == p.TORN and host.state()["epoch"] == 1
    host.ranks.fail_revoke = False
    status, begun = host.call("begin", {}, taker)
    assert status == p.OK and begun["took_over"] and begun["epoch"] == 2 == host.ranks.epoch
    assert host.call("end", {}, taker)[0] == p.OK and host.state()["state"] == "none"


def test_a_session_given_up_forgets_the_base(host):
    who = owner()
    base = committed(host, who)
    host.call("pause", {}, who)
    host.call("begin", {}, who)
    host.call("renew", {"release": True}, who)
    taker = owner()
    status, begun = host.call("begin", {DELTA_KEY: base}, taker)
    assert status == p.OK and not begun[DELTA_KEY]["accepted"]


def test_an_engine_that_raises_answers_a_json_500_and_keeps_serving(host):
    host.ranks.fail_pause = True
    status, answer = host.call("pause", {}, owner())
    assert status == p.ENGINE_FAILED and isinstance(answer, dict) and "injected" in answer["message"]
    host.ranks.fail_pause = False
    assert host.call("pause", {}, owner())[0] == p.OK


def test_a_call_without_the_key_is_refused_401_before_the_core(host):
    status, _ = host.call("pause", {}, owner(), key="wrong")
    assert status == p.UNAUTHORIZED and not host.ranks.paused


def test_a_body_over_the_limit_is_413_and_runs_nothing(host):
    huge = b'{"x": "' + b"a" * (33 << 20) + b'"}'
    status, _ = host.call("pause", path=PATHS[host.kind]["pause"], raw=huge)
    assert status == p.PAYLOAD_TOO_LARGE and not host.ranks.paused


# ---- the sglang plugin's own routes and sglang's weight checker ------------------------------------------


@pytest.mark.parametrize("api_key,admin_api_key", [("key", None), (None, "admin"), ("key", "admin")])
def test_the_plugins_routes_follow_sglangs_admin_key_rules(monkeypatch, api_key, admin_api_key):
    """``/p2pw_apply_deltas`` and ``/renew_weight_update`` are sglang control routes (ADMIN_OPTIONAL):
    with an admin key only the admin key opens them; with both keys the admin key does."""
    from engine_hosts import SglangHost

    host = SglangHost(monkeypatch, api_key=api_key, admin_api_key=admin_api_key)
    opener = admin_api_key or api_key
    for path in ("/p2pw_apply_deltas", "/renew_weight_update"):
        assert host.call("apply", {}, owner(), path=path, key=None)[0] == p.UNAUTHORIZED
        assert host.call("apply", {}, owner(), path=path, key="wrong")[0] == p.UNAUTHORIZED
        status, answer = host.call("apply", {}, owner(), path=path, key=opener)
        assert status == p.BAD_REQUEST and "no weight-update session" in answer["message"], answer  # reached the core


def test_the_weight_checker_cannot_reach_the_plugins_rank_channel_or_reset_the_weights_outside_a_session(monkeypatch):
    from engine_hosts import SglangHost

    host = SglangHost(monkeypatch)
    for action in ("p2pw_revoke", "p2pw_apply_deltas", "p2pw_digest"):
        status, answer = host.call("", {"action": action}, path="/weights_checker")
        assert status == p.BAD_REQUEST and "own channel" in answer["message"], action
    status, answer = host.call("", {"action": "reset_tensors"}, path="/weights_checker")
    assert status == p.BAD_REQUEST and "inside the caller's own session" in answer["message"]
    assert host.call("", {"action": "checksum"}, path="/weights_checker")[0] == p.OK  # a read: anyone's
    who = owner()
    host.call("pause", {}, who)
    host.call("begin", {}, who)
    assert host.call("", {"action": "reset_tensors"}, owner(), path="/weights_checker")[0] == p.CONFLICT
    assert host.call("", {"action": "reset_tensors"}, who, path="/weights_checker")[0] == p.OK


def test_released_memory_refuses_a_begin_and_its_resume_republishes_under_a_new_epoch(monkeypatch):
    """sglang's release/resume of the weights' memory (colocated RL): no writes while released; the
    resume revokes what the old epoch reached and re-publishes before anyone may write. (vLLM's /sleep
    and /wake_up are refused outright; our receiver has no such verbs.)"""
    from engine_hosts import SglangHost

    host = SglangHost(monkeypatch)
    who = owner()
    host.call("pause", {}, who)
    assert host.call("", {}, who, path="/release_memory_occupation")[0] == p.OK
    status, answer = host.call("begin", {}, who)
    assert status == p.BAD_REQUEST and "resume_memory_occupation" in answer["message"]
    host.ranks.fail_revoke = True  # a resume whose re-publication fails: still no begin
    status, answer = host.call("", {}, who, path="/resume_memory_occupation")
    assert status == p.ENGINE_FAILED and "could not revoke" in answer["message"]
    assert host.call("begin", {}, who)[0] == p.BAD_REQUEST
    host.ranks.fail_revoke = False
    assert host.call("", {}, who, path="/resume_memory_occupation")[0] == p.OK
    assert host.ranks.epoch == 2 and host.state()["epoch"] == 2
    status, begun = host.call("begin", {}, who)
    assert status == p.OK and begun["epoch"] == 2
    assert host.call("", {}, who, path="/release_memory_occupation")[0] == p.OK  # inside the session: torn
    assert host.state()["state"] == p.TORN


def test_vllm_refuses_sleep_and_wake_up_which_move_the_registered_memory(monkeypatch):
    from engine_hosts import VllmHost

    host = VllmHost(monkeypatch)
    for path in ("/sleep", "/wake_up"):
        status, answer = host.call("", {}, owner(), path=path)
        assert status == p.BAD_REQUEST and "frees or moves" in answer["message"]


def test_the_engine_names_its_process_in_its_state_and_begins_and_a_restart_is_a_new_name(host, monkeypatch):
    # a sender tells a restarted engine at the same address by this name (sender/engine_set.py)
    instance = host.state()["instance"]
    assert isinstance(instance, str) and len(instance) == 16
    who = owner()
    host.call("pause", {}, who)
    status, begun = host.call("begin", {}, who)
    assert status == p.OK and begun["instance"] == instance
    kind = "receiver" if "receiver" in type(host).__name__.lower() else (
        "sglang" if "sglang" in type(host).__name__.lower() else "vllm")
    again = make(kind, monkeypatch)
    try:
        assert again.state()["instance"] != instance
    finally:
        again.close()


# ---- LoRA adapters: one adapter's slot as a target of its own (engine/adapters.py) ------------------------


def _load(host, name: str, pinned: bool = True) -> tuple[int, dict]:
    return host.call("load", {"lora_name": name, "lora_path": f"/adapters/{name}", "pinned": pinned}, None)


def test_an_adapter_session_answers_the_engines_slot_and_sets_the_adapters_own_version(host):
    who = owner()
    status, loaded = _load(host, "a")
    assert status == p.OK and loaded["p2pw_slot"] == 1, loaded
    host.call("pause", {}, who)
    status, begun = host.call("begin", {"adapter": "a"}, who)
    assert status == p.OK and begun["adapter"] == {"name": "a", "slot": 1}, begun
    status, said = host.call("load", {"lora_name": "b", "lora_path": "/adapters/b", "pinned": True}, who)
    assert status == p.BAD_REQUEST and "end it first" in str(said), said  # the engine's own load waits
    status, said = host.call("end", {}, who)
    assert status == p.BAD_REQUEST and "adapter_version" in str(said), said  # refused: nothing changed
    status, ended = host.call("end", {"adapter_version": "3"}, who)
    assert status == p.OK and set(ended[BASE_KEY]) == {"epoch", "token"}, ended
    assert host.state()["adapters"] == {"a": {"version": "3", "torn": None}}


def test_an_adapter_not_loaded_or_not_pinned_is_refused_at_the_begin_and_nothing_changes(host):
    who = owner()
    base = committed(host, who)
    _load(host, "loose", pinned=False)  # the engine may evict it and give its slot away
    for name in ("missing", "loose"):
        host.call("pause", {}, who)
        status, said = host.call("begin", {"adapter": name}, who)
        assert status == p.BAD_REQUEST and "load_lora_adapter" in str(said), (name, said)
        assert host.state()["state"] == "none"
    host.call("pause", {}, who)
    status, begun = host.call("begin", {DELTA_KEY: base}, who)  # the weights' claim still holds
    assert status == p.OK and begun[DELTA_KEY]["accepted"], begun


def test_a_torn_adapter_keeps_the_engine_paused_until_a_complete_update_of_it(host):
    who = owner()
    _load(host, "a")
    host.call("pause", {}, who)
    assert host.call("begin", {"adapter": "a"}, who)[0] == p.OK
    assert host.call("renew", {"release": True}, who)[0] == p.OK  # given up after its writes began
    assert host.state()["adapters"]["a"]["torn"]
    committed(host, owner())  # a complete update of the weights heals the session, not the adapter
    status, said = host.call("continue", {}, who)
    assert status == p.CONFLICT and "'a'" in str(said), said
    heir = owner()
    host.call("pause", {}, heir)
    assert host.call("begin", {"adapter": "a"}, heir)[0] == p.OK
    assert host.call("end", {"adapter_version": "2"}, heir)[0] == p.OK
    assert host.call("continue", {}, heir)[0] == p.OK
    assert host.state()["adapters"]["a"] == {"version": "2", "torn": None}
