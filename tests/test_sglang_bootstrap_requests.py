"""The sglang plugin's one editor of the requests sglang sends to its engine-info bootstrap server
(sglang_plugin/bootstrap_requests.py): the key's header (bootstrap_key.py), the delta area
(rank_deltas.py) and the epoch (rank_epochs.py), each only inside its own scope, only on its paths.

No server: the hook is called with a stand-in for ``requests.Session.request`` that has its real
signature and returns what would be sent. The real servers: test_sglang_plugin_info.py (the key),
test_sglang_plugin_deltas.py (the area), test_sglang_plugin_fencing.py (the epoch)."""
from __future__ import annotations

import collections
import functools
import inspect
import logging
import types

import pytest
import requests

from conftest import require_sglang

require_sglang()  # skips without sglang; fails in CI

from p2pweights.control import routes  # noqa: E402
from p2pweights.sglang_plugin import bootstrap_key, bootstrap_requests, rank_deltas, rank_epochs  # noqa: E402

GET_PATH = routes.route("get_transfer_engine_info").path
PUT_URL = f"http://192.0.2.7:6789{bootstrap_requests.REGISTER_PATH}"
GET_URL = f"http://192.0.2.7:6789{GET_PATH}?rank=0"
OTHER_URL = "http://192.0.2.7:6789/health"


def sent(*args, **kwargs):
    """What ``requests.Session.request`` would be called with, by parameter name."""
    bound = sent.signature.bind(*args, **kwargs)
    return dict(bound.arguments)


sent.signature = inspect.signature(requests.Session.request)
# the stand-in, as sglang's wrapper hands it to the hook: the real signature, what it was given back
original = functools.wraps(requests.Session.request)(lambda *a, **k: ("called", a, k))


@pytest.fixture
def scopes():
    """Set the three scopes as the modules do (their own ContextVars), each until the test ends."""
    tokens = []

    def enter(key=None, area=None, epoch=None):
        for var, value in ((bootstrap_key._CARRY, bootstrap_key._Carry(key) if key else None),
                           (rank_deltas._PUBLISHING, area), (rank_epochs._PUBLISHING, epoch)):
            if value is not None:
                tokens.append((var, var.set(value)))
        return bootstrap_key._CARRY.get()

    yield enter
    for var, token in reversed(tokens):
        var.reset(token)


def call(*args, **kwargs):
    """The hook with the stand-in; the arguments the request was sent with, by name."""
    result = bootstrap_requests.around_session_request(original, "session", *args, **kwargs)
    assert result[0] == "called"
    return result[1], result[2], sent(*result[1], **result[2])


def test_outside_every_scope_each_request_goes_through_as_given():
    for args, kwargs in [(("PUT", PUT_URL), {"json": {"tp_rank": 0}}), (("GET", GET_URL), {}),
                         (("PUT", PUT_URL, None, None, None, None, None, None, None, True, None, None, None, None,
                           None, {"tp_rank": 0}), {})]:
        assert call(*args, **kwargs)[:2] == (("session", *args), kwargs)


def test_the_key_goes_on_both_bootstrap_paths_only_inside_its_scope(scopes):
    carry = scopes(key="k1")
    _, _, other = call("GET", OTHER_URL, headers={"X": "1"})
    assert other["headers"] == {"X": "1"} and not carry.used  # not a bootstrap path: untouched, not counted
    _, _, get = call("GET", GET_URL, headers={"X": "1"})
    assert get["headers"] == {"X": "1", "Authorization": "Bearer k1"} and carry.used
    _, _, put = call("PUT", PUT_URL, json={"tp_rank": 0})
    assert put["headers"] == {"Authorization": "Bearer k1"} and put["json"] == {"tp_rank": 0}  # no fields: no scope


def test_the_fields_go_only_into_the_registrations_json_object(scopes):
    scopes(area=[4096, 8192], epoch=3)
    _, _, put = call("PUT", PUT_URL, json={"tp_rank": 0, "transfer_engine_info": {}})
    assert put["json"] == {"tp_rank": 0, "transfer_engine_info": {}, "delta_area": [4096, 8192], "epoch": 3}
    assert list(put["json"]) == ["tp_rank", "transfer_engine_info", "delta_area", "epoch"]
    assert put.get("headers") is None  # no key scope: no header
    for url, body in [(GET_URL, {"tp_rank": 0}), (OTHER_URL, {"tp_rank": 0}), (PUT_URL, ["not", "an", "object"])]:
        args, kwargs, _ = call("PUT", url, json=body)
        assert (args, kwargs) == (("session", "PUT", url), {"json": body})  # as given, to the letter


def test_json_and_headers_given_positionally_are_edited_too(scopes):
    scopes(key="k1", epoch=2)
    _, kwargs, put = call("PUT", PUT_URL, None, None, {"X": "1"}, None, None, None, None, True, None, None, None, None,
                          None, {"tp_rank": 0})
    assert put["json"] == {"tp_rank": 0, "epoch": 2} and put["headers"] == {"X": "1", "Authorization": "Bearer k1"}


def test_each_field_is_added_by_its_own_scope_alone(scopes):
    scopes(area=[1, 2])
    assert call("PUT", PUT_URL, json={})[2]["json"] == {"delta_area": [1, 2]}
    scopes(epoch=5)
    assert call("PUT", PUT_URL, json={})[2]["json"] == {"delta_area": [1, 2], "epoch": 5}


def test_the_scopes_are_the_ranks_registration_and_end_with_it(monkeypatch, caplog):
    """sglang's nesting (the epochs' hook inside the area's, the key's innermost), each module's own
    registration hook; a request after it, or without the key's scope, goes as given."""
    import sglang.srt.runtime_context as runtime_context

    monkeypatch.setattr(runtime_context, "get_serving", lambda: types.SimpleNamespace(api_key="k1", admin_api_key=None))
    monkeypatch.setattr(rank_deltas, "AREA", types.SimpleNamespace(published=lambda: [4096, 8192]))
    monkeypatch.setattr(rank_epochs, "REGIONS", types.SimpleNamespace(epoch=1))
    puts = []

    def register_to_engine_info_bootstrap(rank, send=True):  # sglang's PUT, through the hook
        if send:
            puts.append(call("PUT", PUT_URL, json={"tp_rank": 0})[2])

    def publish(rank, send=True):
        def keyed(*a):
            return bootstrap_key.around_rank_registration(register_to_engine_info_bootstrap, *a)

        def with_epoch(*a):
            return rank_epochs.around_rank_registration(keyed, *a)

        return rank_deltas.around_rank_registration(with_epoch, rank, send)

    with caplog.at_level(logging.ERROR, logger=bootstrap_key.__name__):
        publish(types.SimpleNamespace())
    assert puts[0]["json"] == {"tp_rank": 0, "delta_area": [4096, 8192], "epoch": 1}
    assert puts[0]["headers"] == {"Authorization": "Bearer k1"} and not caplog.records
    assert call("PUT", PUT_URL, json={"tp_rank": 0})[1] == {"json": {"tp_rank": 0}}  # the scopes ended
    with caplog.at_level(logging.ERROR, logger=bootstrap_key.__name__):
        publish(types.SimpleNamespace(), False)  # sglang published some other way: the key went nowhere
    assert "without the key" in caplog.text


def test_the_hook_is_registered_once_however_many_modules_ask(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    calls, held = [], collections.defaultdict(list)  # held: sglang's registry, as its register keeps it

    def register(cls, target, hook, hook_type, **kw):
        calls.append((target, hook, hook_type))
        held[target].append((hook_type, hook, None))

    monkeypatch.setattr(HookRegistry, "register", classmethod(register))
    monkeypatch.setattr(HookRegistry, "_hooks", held)
    bootstrap_key.register("scheduler")
    rank_epochs.register()
    rank_deltas.register()
    bootstrap_key.register("main")
    requests_hooks = [(hook, hook_type) for target, hook, hook_type in calls if target == bootstrap_requests.TARGET]
    assert requests_hooks == [(bootstrap_requests.around_session_request, HookType.AROUND)]
    assert bootstrap_key.REQUESTS_TARGET == bootstrap_requests.TARGET
