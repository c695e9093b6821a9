"""The engine core's adapter rules (engine/adapters.py), driven directly with a host that does each step:
an adapter's slot comes from the engine's registry, its base and version are its own, and a torn
adapter keeps the engine paused until a complete update of that adapter (or its unload)."""
from __future__ import annotations

import secrets

import pytest

from p2pweights.control import protocol as p
from p2pweights.deltas.committed import BASE_KEY, DELTA_KEY
from p2pweights.engine import steps
from p2pweights.engine.core import BEGIN, CONTINUE, END, PAUSE, RENEW, EngineCore
from p2pweights.errors import InvalidRequest, OutOfOrder, TornWeights


class FakeHost:
    """Answers every step; ``slots`` is the engine's adapter registry, ``fail_end`` fails the next end."""

    def __init__(self) -> None:
        self.core = EngineCore("e0", lease=30)
        self.paused, self.slots, self.fail_end = False, {}, False
        self.seen: list = []

    def do(self, step: steps.Step):
        self.seen.append(step)
        if isinstance(step, steps.IsPaused):
            return self.paused
        if isinstance(step, steps.DeltaSupport):
            return ""
        if isinstance(step, steps.PublishedEpochs):
            return [self.core.session.epoch]
        if isinstance(step, steps.Revoke):
            return step.epoch
        if isinstance(step, steps.AdapterSlot):
            return self.slots[step.name]  # KeyError: not loaded
        if isinstance(step, steps.End):
            if self.fail_end:
                self.fail_end = False
                raise RuntimeError("injected: a rank failed its end")
            return steps.Answer(p.OK, {"success": True})
        if step.verb == PAUSE:
            self.paused = True
        elif step.verb == CONTINUE:
            self.paused = False
        elif step.verb == "load_lora_adapter":
            self.slots[step.body["lora_name"]] = 1 + len(self.slots)
        elif step.verb == "unload_lora_adapter":
            self.slots.pop(step.body["lora_name"])
        return steps.Answer(p.OK, {"success": True})

    def call(self, verb: str, body: dict | None = None, owner: str | None = None) -> steps.Answer:
        headers = {p.SESSION_OWNER_HEADER: owner} if owner else {}
        return self.core.run(verb, headers, dict(body or {}), self.do)


def _owner() -> str:
    return secrets.token_urlsafe(32)


def _update(host: FakeHost, who: str, adapter: str | None = None, claim: dict | None = None,
            version: str = "1") -> tuple[dict, dict]:
    host.call(PAUSE, {}, who)
    body = {**({"adapter": adapter} if adapter else {}), **({DELTA_KEY: claim} if claim else {})}
    begun = host.call(BEGIN, body, who)
    assert begun.ok, begun.body
    ended = host.call(END, {"adapter_version": version} if adapter else {}, who)
    assert ended.ok, ended.body
    return begun.body, ended.body


def test_the_begin_answers_the_engines_slot_and_skips_nothing_else():
    host, who = FakeHost(), _owner()
    host.call("load_lora_adapter", {"lora_name": "a", "lora_path": "/x", "pinned": True})
    begun, ended = _update(host, who, "a", version="7")
    assert begun["adapter"] == {"name": "a", "slot": 1}
    assert [s for s in host.seen if isinstance(s, steps.EngineVerb) and s.verb == BEGIN][-1].body["adapter"] == "a"
    assert [s for s in host.seen if isinstance(s, steps.End)][-1].body["adapter"] == "a"
    assert host.core.state()["adapters"] == {"a": {"version": "7", "torn": None}}
    assert set(ended[BASE_KEY]) == {"epoch", "token"}


def test_an_adapter_not_loaded_is_refused_before_anything_changes():
    host, who = FakeHost(), _owner()
    _, ended = _update(host, who)  # the weights' base
    host.call(PAUSE, {}, who)
    with pytest.raises(InvalidRequest, match="load_lora_adapter"):
        host.call(BEGIN, {"adapter": "missing"}, who)
    begun = host.call(BEGIN, {DELTA_KEY: ended[BASE_KEY]}, who)  # the weights' claim still holds
    assert begun.ok and begun.body[DELTA_KEY]["accepted"], begun.body


def test_an_adapters_base_and_the_weights_base_are_apart():
    host, who = FakeHost(), _owner()
    host.call("load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})
    _, weights = _update(host, who)
    _, adapter = _update(host, who, "a")
    begun, adapter2 = _update(host, who, "a", claim=adapter[BASE_KEY], version="2")  # the adapter's delta holds
    assert begun[DELTA_KEY]["accepted"]
    begun, _ = _update(host, who, claim=weights[BASE_KEY])  # and so does the weights' after two adapter updates
    assert begun[DELTA_KEY]["accepted"]
    begun, _ = _update(host, who, "a", claim=weights[BASE_KEY])  # one target's claim never holds for another
    assert not begun[DELTA_KEY]["accepted"]
    host.call("unload_lora_adapter", {"lora_name": "a"})
    host.call("load_lora_adapter", {"lora_name": "a", "lora_path": "/y"})  # the engine's own load: base forgotten
    begun, _ = _update(host, who, "a", claim=adapter2[BASE_KEY])
    assert not begun[DELTA_KEY]["accepted"]


def test_an_adapters_end_needs_its_version_and_a_load_waits_for_the_session():
    host, who = FakeHost(), _owner()
    host.call("load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})
    host.call(PAUSE, {}, who)
    assert host.call(BEGIN, {"adapter": "a"}, who).ok
    with pytest.raises(InvalidRequest, match="adapter_version"):
        host.call(END, {}, who)
    with pytest.raises(OutOfOrder, match="end it first"):
        host.call("load_lora_adapter", {"lora_name": "b", "lora_path": "/z"}, who)
    assert host.call(END, {"adapter_version": "3"}, who).ok  # refused calls changed nothing
    with pytest.raises(InvalidRequest, match="adapter name"):
        host.call(BEGIN, {"adapter": "../../etc"}, who)


def test_a_torn_adapter_keeps_the_engine_paused_until_a_complete_update_of_it():
    host, who = FakeHost(), _owner()
    host.call("load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})
    host.call(PAUSE, {}, who)
    assert host.call(BEGIN, {"adapter": "a"}, who).ok
    host.fail_end = True
    assert not host.call(END, {"adapter_version": "1"}, who).ok  # torn
    assert host.core.state()["adapters"]["a"]["torn"]
    with pytest.raises(TornWeights, match="'a'"):
        host.call(CONTINUE, {}, who)
    _update(host, _owner())  # a complete update of the weights heals the session, not the adapter
    with pytest.raises(TornWeights, match="'a'"):
        host.call(CONTINUE, {}, who)
    _update(host, who, "a", version="2")  # a complete update of the adapter does
    assert host.call(CONTINUE, {}, who).ok
    assert host.core.state()["adapters"]["a"] == {"version": "2", "torn": None}


def test_an_adapter_session_given_up_or_unloaded():
    host, who = FakeHost(), _owner()
    host.call("load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})
    host.call(PAUSE, {}, who)
    assert host.call(BEGIN, {"adapter": "a"}, who).ok
    assert host.call(RENEW, {"release": True}, who).ok  # the owner gave it up after writing: torn
    assert host.core.state()["adapters"]["a"]["torn"]
    other = _owner()
    host.call(PAUSE, {}, other)
    assert host.call(BEGIN, {}, other).ok  # a takeover by a weights update
    assert host.call(END, {}, other).ok
    with pytest.raises(TornWeights, match="'a'"):
        host.call(CONTINUE, {}, other)
    assert host.call("unload_lora_adapter", {"lora_name": "a"}, other).ok  # nothing of it can be served now
    assert host.call(CONTINUE, {}, other).ok


def test_an_adapter_update_from_one_of_several_senders_is_refused_naming_the_fix(tmp_path):
    from p2pweights.errors import SenderGroupError
    from p2pweights.sender import WeightSender
    from replica_configs import write_config

    sender = WeightSender(write_config("qwen3", str(tmp_path)), sender_index=1, num_senders=2, transport="mooncake")
    sender._ranks, sender._engines = [object()], [object()]  # as if connected: refused before any engine is asked
    with pytest.raises(SenderGroupError, match="one sender") as refused:
        sender.update(1, adapter="a", adapter_config={"r": 4})
    assert "without group=" in str(refused.value)
    sender._ranks, sender._engines = [], []
    sender.close()
