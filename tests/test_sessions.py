"""Sessions with an owner and a lease; stalled engines (issue 14, items 3 and 6); owners are
secrets and the engine bounds the lease (issue 23, items 2 and 3).

A session belongs to the controller that opened it: another controller's calls are refused (409,
naming the owner) before they change anything; the owner renews a lease while it writes; a session
whose owner stops renewing expires and leaves the engine paused and torn until a complete update
heals it; a stopped engine rank fails the update within the transfer deadline, named.

The first tests run a receiver server in this process (real HTTP, stand-in hooks); the others run
real receiver engines (sglang's model ranks, one process each), real Mooncake / NIXL on 127.0.0.1
and real sender processes.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from p2pweights.control import SglangEngine, UpdateSession
from p2pweights.control import protocol as p
from p2pweights.engine.session import SessionKeeper, SessionState
from p2pweights.errors import P2PWeightsError, SessionConflict, TornWeights, UpdateFailed, UpdateRefused
from p2pweights.receiver import ReceiverHooks, ReceiverServer, check_weights_equal, start_engine, start_engines
from p2pweights.transport.peer import wait_stopped
from replica_configs import write_config


class Recording(ReceiverHooks):
    def __init__(self):
        self.calls: list[str] = []

    def on_pause(self, mode):
        self.calls.append("pause")

    def on_continue(self, torch_empty_cache):
        self.calls.append("continue")

    def on_begin_update(self, selector):
        self.calls.append("begin")

    def on_end_update(self):
        self.calls.append("end")

    def on_weight_version(self, new_version, abort_all_requests):
        self.calls.append("version")

    def init_weights_update_group(self, request):
        self.calls.append("init_group")

    def update_weights_from_distributed(self, request):
        self.calls.append("update_from_distributed")

    def destroy_weights_update_group(self, group_name):
        self.calls.append("destroy_group")


@pytest.fixture
def server():
    hooks = Recording()
    with ReceiverServer(hooks) as s:
        yield s, hooks


def _client(url: str, owner: str | None = None, name: str = "e0", label: str | None = None) -> SglangEngine:
    c = SglangEngine(url, name=name, timeout=10)
    c.session_owner, c.session_label = owner, label
    return c


def _token(word: str) -> str:
    """A test's owner token: long enough for a receiver's begin (``OWNER_MIN_CHARS``)."""
    return f"{word}-{'x' * 32}"


def _weight_update(url: str) -> dict:
    """The session's state, without the engine's process name (``instance``: tests/test_engine_set.py)."""
    state = SglangEngine(url).server_info()["p2pw_weight_update"]
    return {k: v for k, v in state.items() if k != "instance"}


def _raw_health(url: str):
    from p2pweights.control import http

    return http.request("GET", url, "/health", timeout=10)


# ---- the owner rules, on one receiver server ------------------------------------------------------------


def test_another_controllers_calls_answer_409_naming_the_owner_while_the_session_is_live(server):
    srv, hooks = server
    owner = _client(srv.url)
    other = _client(srv.url, owner=_token("trainer-b"))
    with UpdateSession(owner, version=1, lease=30) as session:
        before = list(hooks.calls)
        refused = {
            "pause": lambda: other.pause_generation(),
            "begin": lambda: other.begin_weight_update(),
            "end": lambda: other.end_weight_update(),
            "version": lambda: other.update_weight_version(9),
            "continue": lambda: other.continue_generation(),
            "init_group": lambda: other.init_weights_update_group("127.0.0.1", 1, 1, 2),
            "update_from_distributed": lambda: other.update_weights_from_distributed(["x"], ["bfloat16"], [[1]]),
            "destroy_group": lambda: other.destroy_weights_update_group(),
            "renew": lambda: other.renew_weight_update(),
        }
        for verb, call in refused.items():
            with pytest.raises(SessionConflict) as info:
                call()
            text = str(info.value)
            assert "HTTP 409" in text and f"owner #1 {session.owner_label}" in text and "opened" in text, (verb, text)
            assert session.owner not in text  # the label, never the token
            assert info.value.engine == "e0"
        # an anonymous caller (sglang's own clients) is another controller too
        with pytest.raises(SessionConflict):
            _client(srv.url).continue_generation()
        assert hooks.calls == before  # nothing the others asked reached the engine
        assert _weight_update(srv.url)["owner"] == f"#1 {session.owner_label}"
    # the owner's own end -> version -> continue went through
    assert session.outcome == {"e0": "updated"}
    assert hooks.calls == ["pause", "begin", "end", "version", "continue"]
    assert owner.weight_version() == "1"
    assert _weight_update(srv.url)["state"] == "none"


def test_a_second_session_of_one_process_on_an_engine_is_refused_before_anything_is_sent(server):
    srv, hooks = server
    first = UpdateSession(_client(srv.url), version=1)
    first.open()
    with pytest.raises(UpdateRefused) as info:
        UpdateSession(_client(srv.url, name="again"), version=2).open()
    assert isinstance(info.value, SessionConflict) and info.value.engine == "again"
    assert "another update of this process" in str(info.value) and first.owner not in str(info.value)
    assert hooks.calls == ["pause", "begin"]  # the second sent nothing
    first.commit()
    UpdateSession(_client(srv.url), version=3).__enter__().commit()  # free again once the first ended
    assert _client(srv.url).weight_version() == "3"


def test_the_owner_renews_its_lease_while_it_writes(server):
    srv, hooks = server
    # a lease long enough that a loaded 2-core CI host's stalls (2.9 s and 3.4 s seen) do not outlast
    # it; the renewals run every third of it, so the session outlives two leases only by being renewed
    with UpdateSession(_client(srv.url), version=4, lease=6.0) as session:
        time.sleep(12.5)  # "writing" for more than two leases
        assert _weight_update(srv.url)["state"] == "open"
    assert session.outcome == {"e0": "updated"}


def test_an_owner_that_stops_renewing_leaves_the_engine_paused_and_torn_until_a_complete_update(server):
    srv, hooks = server
    gone = _client(srv.url, owner=_token("dead"), label="dead-trainer")
    gone.pause_generation()
    gone.begin_weight_update(lease=3.0)  # and never a renewal (3 s: a loaded CI host stalls up to ~3.4 s)
    with pytest.raises(SessionConflict, match="dead-trainer"):
        _client(srv.url, owner=_token("b")).continue_generation()  # live: another's
    time.sleep(4.0)
    status, body = _raw_health(srv.url)
    assert status == p.OK and body["status"] == p.TORN and "dead-trainer" in body["message"]
    assert "expired" in body["message"]
    state = _weight_update(srv.url)
    assert state["state"] == p.TORN and state["owner"] is None
    for call in (lambda c: c.continue_generation(), lambda c: c.update_weight_version(5),
                 lambda c: c.end_weight_update()):
        for caller in (_client(srv.url), _client(srv.url, owner=_token("dead"))):
            with pytest.raises(TornWeights) as info:
                call(caller)
            assert "HTTP 409" in str(info.value) and "complete update heals" in str(info.value)
    assert hooks.calls == ["pause", "begin"]
    # the next controller takes the session over; its complete update heals the engine
    with UpdateSession(_client(srv.url), version=6) as session:
        assert _weight_update(srv.url)["state"] == "open"
    assert session.resumed == {"e0"} and session.outcome == {"e0": "updated"}
    assert hooks.calls == ["pause", "begin", "pause", "end", "version", "continue"]  # taken over, not begun again
    assert _raw_health(srv.url) == (p.OK, None)
    assert _weight_update(srv.url)["state"] == "none"


def test_the_keeper_reports_its_session_state_as_the_enum_and_json_reads_the_protocol_words():
    now = [0.0]
    keeper = SessionKeeper("e0", lease=1.0, clock=lambda: now[0])
    seen = [keeper.state()["state"]]
    keeper.begin("trainer", None)
    seen.append(keeper.state()["state"])
    now[0] = 2.0  # past the lease: expired, torn
    seen.append(keeper.state()["state"])
    assert seen == [SessionState.NONE, SessionState.OPEN, SessionState.TORN]
    assert all(isinstance(s, SessionState) for s in seen)
    assert [json.loads(json.dumps({"state": s}))["state"] for s in seen] == ["none", "open", p.TORN]
    assert keeper.health()["status"] == p.TORN


def test_a_failed_update_gives_its_session_up_so_the_next_one_heals_at_once(server):
    srv, hooks = server
    with pytest.raises(RuntimeError):
        with UpdateSession(_client(srv.url), version=1, lease=300):
            raise RuntimeError("a write failed")
    status, body = _raw_health(srv.url)  # torn at once, not after the 300 s lease
    assert body["status"] == p.TORN and "given up" in body["message"]
    with pytest.raises(TornWeights):
        _client(srv.url).continue_generation()
    with UpdateSession(_client(srv.url), version=2) as session:
        pass
    assert session.resumed == {"e0"} and _client(srv.url).weight_version() == "2"


def test_an_engine_that_fails_the_check_in_before_the_end_is_named_and_left_paused_while_the_others_finish():
    from p2pweights.errors import EngineError, EnginesFailed

    class StalledRank(Recording):
        def on_renew_lease(self):
            raise EngineError("engine s: ping failed on 1 rank(s): rank 1: no answer within 3s", engine="s", rank=1)

    class SilentLeader(Recording):
        def on_renew_lease(self):
            time.sleep(8.0)  # far longer than the client's check-in allows (1.6 s here)

    good, stalled, silent = Recording(), StalledRank(), SilentLeader()
    with ReceiverServer(good) as a, ReceiverServer(stalled) as b, ReceiverServer(silent) as c:
        clients = [_client(a.url, name="a"), _client(b.url, name="b"), SglangEngine(c.url, name="c", connect_timeout=0.2)]
        t0 = time.monotonic()
        with pytest.raises(EnginesFailed) as info:
            with UpdateSession(clients, version=2, lease=30):
                pass  # every write returned
        assert time.monotonic() - t0 < 6.0  # given up at the check-in's timeout, not the silent leader's 8 s
        assert set(info.value.failures) == {"b", "c"}
        assert info.value.errors["b"].rank == 1 and "rank 1" in info.value.failures["b"]
        assert info.value.errors["c"].rank == 0 and "rank 0" in info.value.failures["c"]
        assert good.calls[-3:] == ["end", "version", "continue"] and _client(a.url).weight_version() == "2"
        for url, hooks in ((b.url, stalled), (c.url, silent)):
            assert hooks.calls == ["pause", "begin"]  # not ended, not bumped, not continued
            assert _weight_update(url)["state"] == p.TORN  # given up: the next complete update heals it


def test_a_session_an_sglang_server_says_is_open_is_resumed_only_by_its_own_owner():
    class SglangLike(ReceiverServer):
        """sglang keeps no owners: its begin answers 400 "already open" to anyone."""

        def _begin_weight_update(self, body):
            return p.BAD_REQUEST, {"success": False, "message": f"a weight-update session is {p.SESSION_ALREADY_OPEN}"}

        def control(self, verb, headers, body):  # no engine core: plain sglang ends any open session
            if verb == "end_weight_update":
                return p.OK, self._end(None).body
            return super().control(verb, headers, body)

    hooks = Recording()
    with SglangLike(hooks) as srv:
        srv.updating = True  # a session some sglang client opened
        with pytest.raises(UpdateRefused, match="did not open it") as info:
            UpdateSession(_client(srv.url), version=1).open()
        assert "end_weight_update" in info.value.errors["e0"].hint
        assert hooks.calls == ["pause"]  # refused before writing; and not continued: it may be torn
        with UpdateSession(_client(srv.url), version=2, owner="the-one-that-opened-it") as session:
            pass
        assert session.resumed == {"e0"}


# ---- owners are secrets (issue 23, item 2) ------------------------------------------------------------


def _every_route_answer(url: str, headers: dict | None = None) -> list[str]:
    """What every route answers, every method it takes, to a caller with ``headers`` (as text)."""
    from p2pweights.control import http, routes

    said = []
    for route in routes.ROUTES:
        for method in route.methods:
            status, answer = http.request(method, url, route.path, body={} if method != "GET" else None,
                                          params={"rank": 0}, timeout=10, headers=headers)
            said.append(f"{method} {route.path} {status} {json.dumps(answer)}")
    return said


def test_the_owner_token_appears_in_no_answer_and_a_copied_label_is_refused_409(server, caplog):
    import logging

    from p2pweights.control.lease import new_owner_id

    caplog.set_level(logging.DEBUG)
    srv, hooks = server
    session = UpdateSession(_client(srv.url), version=1, lease=30)
    session.open()
    token = session.owner
    assert len(token) >= 43 and len({new_owner_id() for _ in range(64)}) == 64  # 256 random bits each
    assert str(os.getpid()) not in token  # nothing of it is derived from what an attacker can see
    shown = _weight_update(srv.url)["owner"]
    assert shown == f"#1 {session.owner_label}" and str(os.getpid()) in shown
    # a key holder copies everything it can read and tries it as the owner header
    copied = [shown, session.owner_label, shown + "-" * 32, json.dumps(_raw_health(srv.url)[1])]
    answers = _every_route_answer(srv.url) + _every_route_answer(srv.url, {p.SESSION_OWNER_HEADER: copied[2]})
    for fake in copied:
        attacker = _client(srv.url, owner=fake)
        for call in (lambda: attacker.continue_generation(), lambda: attacker.update_weight_version(9),
                     lambda: attacker.end_weight_update(), lambda: attacker.renew_weight_update(),
                     lambda: attacker.renew_weight_update(release=True), lambda: attacker.begin_weight_update()):
            with pytest.raises(SessionConflict) as info:
                call()
            assert "HTTP 409" in str(info.value)
            answers.append(str(info.value))
    answers += [json.dumps(_raw_health(srv.url)[1]), json.dumps(SglangEngine(srv.url).server_info())]
    assert hooks.calls == ["pause", "begin"]  # nothing the copies asked reached the engine
    assert _weight_update(srv.url)["state"] == "open"  # still the owner's (a copied release did nothing)
    assert not [a for a in answers if token in a]
    session.commit()  # the owner itself goes on
    assert hooks.calls[-3:] == ["end", "version", "continue"]
    assert token not in caplog.text


def test_the_owner_token_goes_to_the_engine_only_never_to_its_bootstrap_server(server):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Bootstrap(BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(dict(self.headers))
            body = json.dumps({"rank": 0, "remote_instance_transfer_engine_info": ["s", {}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv, hooks = server
    bootstrap = ThreadingHTTPServer(("127.0.0.1", 0), Bootstrap)
    threading.Thread(target=bootstrap.serve_forever, daemon=True).start()
    try:
        client = SglangEngine(srv.url, bootstrap_url=f"http://127.0.0.1:{bootstrap.server_port}", name="e0")
        with UpdateSession(client, version=1) as session:
            client.transfer_engine_info(0)
        assert seen and not [h for h in seen if session.owner in json.dumps(h)]
        assert hooks.calls == ["pause", "begin", "end", "version", "continue"]  # the engine got it
    finally:
        bootstrap.shutdown()
        bootstrap.server_close()


def test_a_begin_with_a_guessable_owner_token_is_refused_400_without_repeating_it(server):
    srv, hooks = server
    weak = _client(srv.url, owner="trainer-b")
    weak.pause_generation()  # no session to take: anyone's
    with pytest.raises(P2PWeightsError) as info:
        weak.begin_weight_update()
    assert "HTTP 400" in str(info.value) and p.SESSION_OWNER_HEADER in str(info.value)
    assert "trainer-b" not in str(info.value)
    assert hooks.calls == ["pause"] and _weight_update(srv.url)["state"] == "none"


def test_a_label_that_carries_the_owner_token_is_never_shown():
    from p2pweights.engine.session import label_of

    token = _token("t")
    assert label_of({p.SESSION_LABEL_HEADER: f"host:1 {token}"}, token) == ""
    assert label_of({p.SESSION_LABEL_HEADER: "host:1\x1b[2J" + "y" * 100}, token) == "host:1[2J" + "y" * 55


# ---- the engine bounds the lease (issue 23, item 3) ------------------------------------------------------


def test_the_keeper_caps_every_lease_to_the_engines_own_and_refuses_nonsense():
    from p2pweights.engine.session import lease_of
    from p2pweights.errors import InvalidRequest

    now = [0.0]
    keeper = SessionKeeper("e0", lease=5.0, clock=lambda: now[0])
    assert keeper.begin("trainer", 30.0) is False and keeper.lease == 5.0
    assert keeper.renew(1e309) == 5.0 and keeper.renew(2.0) == 2.0 and keeper.renew(None) == 2.0
    assert [keeper.grant(x) for x in (float("inf"), 100.0, 0.5, None)] == [5.0, 5.0, 0.5, 5.0]
    for raw, granted in (("inf", 5.0), ("1e309", 5.0), ("Infinity", 5.0), ("30", 5.0), ("0.25", 0.25)):
        assert keeper.grant(lease_of({p.SESSION_LEASE_HEADER: raw})) == granted, raw
    for raw in ("nan", "-1", "0", "-inf", "abc", "", "1e309x"):
        with pytest.raises(InvalidRequest, match=p.SESSION_LEASE_HEADER):
            lease_of({p.SESSION_LEASE_HEADER: raw})
    with pytest.raises(ValueError, match="finite"):
        SessionKeeper("e0", lease=float("inf"))


def test_an_engine_with_a_1s_lease_expires_a_sender_that_asked_for_30s_and_stopped_renewing():
    hooks = Recording()
    with ReceiverServer(hooks, session_lease=1.0) as srv:
        gone = _client(srv.url, owner=_token("gone"))
        gone.pause_generation()
        answer = gone.begin_weight_update(lease=30)  # and never a renewal
        assert answer["lease"] == 1.0 and answer["lease_max"] == 1.0
        assert _weight_update(srv.url)["lease_s"] == 1.0
        time.sleep(3.0)  # three of the engine's leases (the sender asked for 30 s)
        assert _weight_update(srv.url)["state"] == p.TORN
        assert "lease 1s" in _raw_health(srv.url)[1]["message"]


def test_infinite_or_nonsense_lease_requests_never_hold_the_engine():
    from p2pweights.control import http

    capped, refused = ("inf", "1e309", "Infinity"), ("nan", "-1", "abc", "")
    servers = [ReceiverServer(Recording(), session_lease=1.0).start() for _ in capped + refused]
    try:
        for raw, srv in zip(capped + refused, servers):
            owner = {p.SESSION_OWNER_HEADER: _token(f"asks-{raw}")}
            assert http.request("POST", srv.url, "/pause_generation", body={}, headers=owner, timeout=10)[0] == p.OK
            status, answer = http.request("POST", srv.url, "/begin_weight_update", body={}, timeout=10,
                                          headers={**owner, p.SESSION_LEASE_HEADER: raw})
            if raw in capped:
                assert (status, answer["lease"]) == (p.OK, 1.0), (raw, answer)
            else:  # refused before anything ran: no session
                assert status == p.BAD_REQUEST and p.SESSION_LEASE_HEADER in answer["message"], (raw, answer)
                assert srv.hooks.calls == ["pause"] and _weight_update(srv.url)["state"] == "none"
        time.sleep(3.0)
        for raw, srv in zip(capped, servers):
            assert _weight_update(srv.url)["state"] == p.TORN, raw  # expired after the engine's 1 s
    finally:
        for srv in servers:
            srv.close()


def test_the_sender_renews_at_a_fraction_of_the_granted_lease_and_its_deadline_follows_the_renewals():
    # the engine's lease (4 s) outlasts a loaded CI host's stalls (3.4 s seen); it still grants less
    # than the 30 s asked
    with ReceiverServer(Recording(), session_lease=4.0) as srv:
        t0 = time.monotonic()
        session, told = UpdateSession(_client(srv.url), version=1, lease=30), []
        session.renewer.on_deadline = lambda name, deadline: told.append((name, deadline))
        with session:
            first = session.lease_deadline()
            assert session.renewer.lease == 4.0 and session.renewer.granted == {"e0": 4.0}  # not the 30 s asked
            assert t0 < first <= time.monotonic() + 4.0 * 0.9
            assert session.lease_deadline("e0") == first and session.lease_deadline("not-an-engine") == float("inf")
            time.sleep(10.0)  # two and a half of the engine's leases: only renewals keep it open
            state = _weight_update(srv.url)
            assert (state["state"], state["lease_s"]) == ("open", 4.0)
            now = time.monotonic()
            assert first < now < session.lease_deadline() <= now + 4.0  # moved on by the renewals
        assert session.outcome == {"e0": "updated"}
        assert told[0] == ("e0", first) and len(told) >= 4  # the begin, then each renewal (every ~1.3 s)
        assert [d for _, d in told] == sorted(d for _, d in told)
        assert session.lease_deadline() == float("-inf")  # over: no more posts


def test_the_owners_deadline_passes_when_renewals_stop_and_is_minus_inf_once_the_engine_refused():
    with ReceiverServer(Recording(), session_lease=3.0) as srv:  # 3 s: outlasts a loaded CI host's stalls
        session = UpdateSession(_client(srv.url), version=1, lease=30)
        session.open()
        assert session.lease_deadline() > time.monotonic()
        session._renewer._stop.set()  # the renewal thread stops (a paused or partitioned sender)
        time.sleep(4.0)
        assert session.lease_deadline() < time.monotonic()  # past, by the sender's own clock
        assert _weight_update(srv.url)["state"] == p.TORN  # and the engine agrees
        session._renewer._stop.clear()  # renewing again after the pause: the engine refuses it
        told = []
        session.renewer.on_deadline = lambda name, deadline: told.append((name, deadline))
        errors = session._renewer.check_in(session.engines)
        assert isinstance(errors["e0"], TornWeights)
        assert session.lease_deadline() == float("-inf") and told == [("e0", float("-inf"))]
        session.abort("the sender lost its session")


def test_a_late_owner_whose_session_another_controller_took_over_and_ended_gets_a_minus_inf_deadline():
    with ReceiverServer(Recording(), session_lease=1.0) as srv:
        late = UpdateSession(_client(srv.url), version=1, lease=30)
        late.open()
        late.renewer._stop.set()  # stopped past its lease
        time.sleep(2.5)
        other = _client(srv.url, owner=_token("next"))
        other.pause_generation()
        assert other.begin_weight_update()["took_over"] is True
        other.end_weight_update()  # healed and over: the engine has no session at all
        errors = late.renewer.check_in(late.engines)  # the late owner resumes: "nothing to renew" (400)
        assert p.NO_SESSION in str(errors["e0"])
        assert late.lease_deadline() == float("-inf")
        late.abort("lost its session")


def test_a_session_given_up_ends_the_owners_deadline_at_once():
    with ReceiverServer(Recording(), session_lease=30.0) as srv:
        session = UpdateSession(_client(srv.url), version=1)
        session.open()
        assert session.lease_deadline() > time.monotonic() + 20
        session._renewer.release(session.engines)
        assert session.lease_deadline() == float("-inf")
        assert _weight_update(srv.url)["state"] == p.TORN
        session.abort("given up")


# ---- real engines, real transports, real sender processes ----------------------------------------------

CHILD = textwrap.dedent('''
    import json, os, sys, time
    from p2pweights.errors import P2PWeightsError, SessionConflict
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
    from p2pweights.sender import WeightSender

    cfg, url, seed, mode, go, transport = sys.argv[1:7]
    def say(**kw):
        print(json.dumps(kw), flush=True)
    if mode == "inside":  # stopped inside a post: its fence check passed, the write goes out on resume
        import signal
        from p2pweights.transport import mooncake, nixl
        backend = mooncake.MooncakeBackend if transport == "mooncake" else nixl.NixlBackend
        real_post, posts = backend.post, []
        def post(self, engine, local, remote, lengths):
            posts.append(engine)
            if len(posts) == 1:  # this small model's update is one slot: its first post
                say(event="writing", slots=len(posts))
                os.kill(os.getpid(), signal.SIGSTOP)
            return real_post(self, engine, local, remote, lengths)
        backend.post = post
    sender = WeightSender(cfg, transport=transport, buffer_size=1 << 20,
                          nixl_api="python" if mode == "inside" else None)
    sender.connect([url])
    items = list(random_checkpoint(checkpoint_tensors(cfg), int(seed)))
    say(event="ready", pid=os.getpid())
    while not os.path.exists(go):
        time.sleep(0.005)
    try:
        with sender.update(f"seed{seed}") as update:
            for i, (name, t) in enumerate(items):
                update.push(name, t)
                if mode == "slow" and i == 0:
                    time.sleep(2.0)  # holds its session: the other controller certainly meets it
                if mode in ("hold", "late") and i == len(items) * 3 // 4:
                    update.pipeline.drain()  # what is placed goes out now: its writes begin
                    if mode == "late":  # stopped between posts, not inside one (docs/security.md: the window)
                        time.sleep(1.0)
                    say(event="writing", slots=update.times.slots)
                    if mode == "hold":
                        time.sleep(600)  # until killed
                    while not os.path.exists(go + ".resume"):  # stopped here (SIGSTOP), then resumed
                        time.sleep(0.005)
        if mode == "inside":
            while not os.path.exists(go + ".resume"):
                time.sleep(0.005)
        say(event="done")
    except SessionConflict as e:
        say(event="refused", error=str(e), engine=e.engine)
    except P2PWeightsError as e:
        say(event="failed", error=str(e))
    sys.stdout.flush()
    os._exit(0)
''')


class SenderProcess:
    """One trainer's sender in its own process (its own controller)."""

    def __init__(self, cfg: str, url: str, seed: int, mode: str, go: str, transport: str, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, cfg, url, str(seed), mode, go, transport],
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def next_event(self, timeout: float = 180.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no event from the sender process in {timeout:.0f} s") from None
            if line is None:
                raise RuntimeError(f"sender process exited ({self.proc.poll()})")
            try:
                return json.loads(line)
            except ValueError:
                continue

    def _read(self) -> None:  # a thread: next_event's timeout holds even when the child prints nothing
        try:
            for line in self.proc.stdout:
                self._lines.put(line)
        except (OSError, ValueError):  # closed by close()
            pass
        self._lines.put(None)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.proc.stdout.close()


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return write_config("qwen3", str(tmp_path_factory.mktemp("configs")))


def _update(cfg: str, urls: list[str], seed: int, transport: str, **kw) -> None:
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
    from p2pweights.sender import WeightSender

    with WeightSender(cfg, transport=transport, buffer_size=1 << 20, **kw) as sender:
        sender.connect(urls)
        with sender.update(f"seed{seed}") as update:
            for name, t in random_checkpoint(checkpoint_tensors(cfg), seed):
                update.push(name, t)


def test_concurrent_controllers_exactly_one_wins_and_the_weights_are_all_the_winners(cfg, tmp_path):
    engine = start_engine(cfg, "tp=2", transport="mooncake", name="shared")
    go = str(tmp_path / "go")
    senders = [SenderProcess(cfg, engine.url, seed, "slow", go, "mooncake") for seed in (21, 22)]
    try:
        for s in senders:
            assert s.next_event()["event"] == "ready"
        open(go, "w").close()  # both controllers start their update at once
        results = {seed: s.next_event(120) for seed, s in zip((21, 22), senders)}
        events = sorted(r["event"] for r in results.values())
        assert events == ["done", "refused"], results
        winner = next(seed for seed, r in results.items() if r["event"] == "done")
        refused = next(r for r in results.values() if r["event"] == "refused")
        assert refused["engine"] and refused["engine"] in refused["error"]
        assert "owner #" in refused["error"] and "HTTP 409" in refused["error"]
        result = check_weights_equal(engine.url, hf_seed=winner)
        assert result["success"], result["message"]  # every byte of every rank is the winner's
        assert SglangEngine(engine.url).weight_version() == f"seed{winner}"
        assert _weight_update(engine.url)["state"] == "none"
    finally:
        for s in senders:
            s.close()
        engine.close()


def test_a_second_update_on_one_sender_is_refused_while_the_first_is_open(cfg):
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
    from p2pweights.sender import WeightSender

    engine = start_engine(cfg, "tp=1", transport="mooncake", name="one")
    try:
        with WeightSender(cfg, transport="mooncake", buffer_size=1 << 20) as sender:
            sender.connect([engine.url])
            items = list(random_checkpoint(checkpoint_tensors(cfg), 3))
            first = sender.update("seed3")
            first.push(*items[0])  # the session is open
            with pytest.raises(P2PWeightsError, match="still in flight"):
                sender.update("seed4")
            for name, t in items[1:]:
                first.push(name, t)
            first.finish()
        assert check_weights_equal(engine.url, hf_seed=3)["success"]
    finally:
        engine.close()


def test_a_sender_killed_mid_update_leaves_the_engine_torn_after_its_lease_then_a_complete_update_heals_it(
        cfg, tmp_path):
    engine = start_engine(cfg, "tp=2", transport="mooncake", name="victim")
    go = str(tmp_path / "go")
    open(go, "w").close()
    child = SenderProcess(cfg, engine.url, 41, "hold", go, "mooncake", env={"P2PW_SESSION_LEASE": "2"})
    try:
        assert child.next_event()["event"] == "ready"
        writing = child.next_event(120)
        assert writing["event"] == "writing" and writing["slots"] > 0  # its writes began
        child.proc.send_signal(signal.SIGKILL)
        child.proc.wait(10)
        killed_at = time.monotonic()
        client = SglangEngine(engine.url, name="victim")
        assert _weight_update(engine.url)["state"] == "open"  # its lease runs on a little
        while _weight_update(engine.url)["state"] == "open" and time.monotonic() - killed_at < 10:
            time.sleep(0.2)
        assert time.monotonic() - killed_at < 2 + 5  # the 2 s lease, then expiry; the loop above gives up at 10
        status, body = _raw_health(engine.url)
        assert status == p.OK and body["status"] == p.TORN and "expired" in body["message"]
        assert SglangEngine(engine.url).server_info()["p2pw_weight_update"]["state"] == p.TORN
        with pytest.raises(TornWeights, match="complete update heals"):
            client.continue_generation()
        with pytest.raises(TornWeights):
            client.update_weight_version("seed41")
        assert client.weight_version() == "default"
        _update(cfg, [engine.url], 42, "mooncake")  # a complete update, by another controller
        assert check_weights_equal(engine.url, hf_seed=42)["success"]
        assert _raw_health(engine.url) == (p.OK, None)
        assert client.weight_version() == "seed42"
        client.pause_generation()
        client.continue_generation()  # generating again, as any healthy engine
    finally:
        child.close()
        engine.close()


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_a_sender_stopped_past_its_lease_lands_no_byte_after_another_controller_committed(cfg, tmp_path, transport):
    """Issue 23's silent corruption: a sender is stopped (SIGSTOP: a GC pause, a partition) half
    way through its update, between two posts; its lease expires; another controller runs a complete
    update; the first sender resumes and keeps pushing. Its writer is fenced at its lease (less a
    margin): it posts nothing more, its update fails naming the lease, and every byte of the engine
    stays the second controller's, under the second controller's version. (A stop inside a post is
    the window docs/security.md measures: the fence stops posts, not bytes already posted.)"""
    engine = start_engine(cfg, "tp=2", transport=transport, name="fenced")
    go = str(tmp_path / "go")
    open(go, "w").close()
    child = SenderProcess(cfg, engine.url, 51, "late", go, transport, env={"P2PW_SESSION_LEASE": "2"})
    try:
        assert child.next_event()["event"] == "ready"
        assert child.next_event(120)["event"] == "writing"
        child.proc.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        while _weight_update(engine.url)["state"] == "open" and time.monotonic() - stopped_at < 20:
            time.sleep(0.2)
        assert _weight_update(engine.url)["state"] == p.TORN  # its lease expired: torn, not served
        _update(cfg, [engine.url], 52, transport)  # another controller: a complete update
        assert check_weights_equal(engine.url, hf_seed=52)["success"]
        open(go + ".resume", "w").close()
        child.proc.send_signal(signal.SIGCONT)  # the late sender pushes the rest of its update
        result = child.next_event(120)
        assert result["event"] in ("failed", "refused"), result
        assert "lease" in result["error"], result["error"]
        child.proc.wait(30)
        time.sleep(1.0)  # anything still on the wire has landed by now
        after = check_weights_equal(engine.url, hf_seed=52)
        assert after["success"], after["message"]  # not one byte of the late sender's
        assert SglangEngine(engine.url).weight_version() == "seed52"
        assert _weight_update(engine.url)["state"] == "none"
    finally:
        child.close()
        engine.close()


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_a_sender_stopped_inside_a_post_lands_nothing_after_a_takeover_revoked_its_epoch(cfg, tmp_path, transport):
    """The window the sender's fence cannot close: a sender stopped inside a post (its fence check
    passed; its write goes out when it resumes). The takeover revokes the lost owner's epoch: every
    rank moves its registrations to a new endpoint and closes the old one, so the resumed write
    fails; every byte stays the second controller's. (With the revocation removed this write lands:
    docs/security.md, "Epochs", has the measurement.)"""
    engine = start_engine(cfg, "tp=2", transport=transport, name="revoked")
    go = str(tmp_path / "go")
    open(go, "w").close()
    child = SenderProcess(cfg, engine.url, 61, "inside", go, transport, env={"P2PW_SESSION_LEASE": "2"})
    try:
        assert child.next_event()["event"] == "ready"
        assert child.next_event(120)["event"] == "writing"  # it stopped itself inside its first post
        wait_stopped(child.proc.pid)
        before = SglangEngine(engine.url).server_info()["p2pw_weight_update"]["epoch"]
        stopped_at = time.monotonic()
        while _weight_update(engine.url)["state"] == "open" and time.monotonic() - stopped_at < 20:
            time.sleep(0.2)
        assert _weight_update(engine.url)["state"] == p.TORN
        _update(cfg, [engine.url], 62, transport)  # another controller takes over: a new epoch
        assert _weight_update(engine.url) == {"state": "none", "epoch": before + 1}
        assert check_weights_equal(engine.url, hf_seed=62)["success"]
        open(go + ".resume", "w").close()
        child.proc.send_signal(signal.SIGCONT)  # its post goes out, to the revoked epoch's endpoint
        result = child.next_event(120)
        assert result["event"] in ("failed", "refused"), result
        child.proc.wait(30)
        time.sleep(1.0)  # anything still on the wire has landed by now
        after = check_weights_equal(engine.url, hf_seed=62)
        assert after["success"], after["message"]  # not one byte of the late sender's
        assert SglangEngine(engine.url).weight_version() == "seed62"
    finally:
        child.close()
        engine.close()


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_a_sender_connected_before_a_takeover_follows_the_new_epoch_and_writes_every_byte(cfg, tmp_path, transport):
    """A controller connected at epoch 1; the engine's owner is lost and it takes the session over:
    its begin answers epoch 2, so before any write it fetches the ranks' new publications (the same
    table, a new endpoint) and re-attaches them. The update is byte-exact; a second one needs nothing."""
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
    from p2pweights.sender import WeightSender

    engine = start_engine(cfg, "tp=2", transport=transport, name="follows")
    go = str(tmp_path / "go")
    open(go, "w").close()
    child = SenderProcess(cfg, engine.url, 71, "hold", go, transport, env={"P2PW_SESSION_LEASE": "2"})
    try:
        with WeightSender(cfg, transport=transport, buffer_size=1 << 20) as sender:
            sender.connect([engine.url])  # epoch 1's publications
            peers = {t.publication.peer for p in sender._ranks for t in p.targets}
            assert child.next_event()["event"] == "ready"
            assert child.next_event(120)["event"] == "writing"
            child.proc.send_signal(signal.SIGKILL)  # the owner is lost; its lease runs out
            child.proc.wait(10)
            killed_at = time.monotonic()
            while _weight_update(engine.url)["state"] == "open" and time.monotonic() - killed_at < 20:
                time.sleep(0.2)
            for seed in (72, 73):
                with sender.update(f"seed{seed}") as update:
                    for name, t in random_checkpoint(checkpoint_tensors(cfg), seed):
                        update.push(name, t)
                assert check_weights_equal(engine.url, hf_seed=seed)["success"]
            now = {t.publication.peer for p in sender._ranks for t in p.targets}
            assert {t.publication.epoch for p in sender._ranks for t in p.targets} == {2}
            assert not peers & now  # every rank moved to a new endpoint
        assert SglangEngine(engine.url).weight_version() == "seed73"
    finally:
        child.close()
        engine.close()


@pytest.mark.parametrize("transport", ["nixl", "mooncake"])
@pytest.mark.parametrize("when", ["writing", "ending"])
def test_a_stopped_engine_rank_fails_the_update_within_the_deadline_naming_it(cfg, transport, when):
    """Rank 1 of one engine is SIGSTOPped while the update writes (its writes time out), or after
    every write returned, just before the end (the check-in before end_weight_update finds it)."""
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
    from p2pweights.sender import WeightSender

    healthy, stalled = start_engines(cfg, "tp=2", count=2, transport=transport, name_prefix=f"stall-{transport}-")
    deadline = 5.0
    stopped = stalled.pids[1]
    try:
        with WeightSender(cfg, transport=transport, buffer_size=1 << 20, transfer_timeout=deadline) as sender:
            sender.connect([SglangEngine(e.url, name=e.name) for e in (healthy, stalled)])
            items = list(random_checkpoint(checkpoint_tensors(cfg), 51))
            with pytest.raises(UpdateFailed) as info:
                with sender.update("seed51") as update:
                    update.push(*items[0])  # the engines are paused, the session is open
                    if when == "writing":
                        os.kill(stopped, signal.SIGSTOP)
                        t0 = time.monotonic()
                    for name, t in items[1:]:
                        update.push(name, t)
                    if when == "ending":
                        update.pipeline.drain()
                        time.sleep(1.0)  # every write has landed
                        os.kill(stopped, signal.SIGSTOP)
                        t0 = time.monotonic()
            took = time.monotonic() - t0
        text = str(info.value)
        assert took < deadline + 10, f"took {took:.1f}s: {text}"
        assert (info.value.engine, info.value.rank) == (stalled.name, 1), text
        assert stalled.name in text and ("rank 1" in text or "rank1" in text), text
        # the healthy engine is not held: updated (its writes completed; the stopped rank was found
        # just before the end) or left paused and torn (the writes timed out; some may have landed)
        state = _weight_update(healthy.url)["state"]
        assert state in ("none", p.TORN), state
        if when == "ending":
            assert state == "none" and check_weights_equal(healthy.url, hf_seed=51)["success"]
            assert SglangEngine(healthy.url).weight_version() == "seed51"
        assert SglangEngine(stalled.url).weight_version() == "default"
    finally:
        os.kill(stopped, signal.SIGCONT)
        healthy.close()
        stalled.close()


@pytest.mark.parametrize("transport", ["mooncake", "nixl"])
def test_a_connect_whose_epoch_a_takeover_revoked_mid_way_connects_to_the_new_one(cfg, monkeypatch, transport):
    """The connect fetched epoch 1's publications; before it connected, a takeover revoked them (the old
    endpoint is closed): it fetches the rank's publication again, checks it and connects to epoch 2,
    then writes every byte."""
    import secrets

    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
    from p2pweights.sender import WeightSender, attach

    engine = start_engine(cfg, "tp=1", transport=transport, name="racing")
    real, raced = attach.transports.attach_engine, []

    def take_over() -> None:  # another controller's session given up, then a third's takeover (which revokes)
        lost, taker = (SglangEngine(engine.url, name=n) for n in ("lost", "taker"))
        lost.session_owner, taker.session_owner = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        lost.pause_generation()
        lost.begin_weight_update()
        lost.renew_weight_update(release=True)
        assert taker.begin_weight_update()["epoch"] == 2
        taker.end_weight_update()
        taker.continue_generation()

    def racing(transport_obj, writer, writer_id, name, pub):
        if not raced:
            raced.append(pub.epoch)
            take_over()
        return real(transport_obj, writer, writer_id, name, pub)

    monkeypatch.setattr(attach.transports, "attach_engine", racing)
    try:
        with WeightSender(cfg, transport=transport, buffer_size=1 << 20) as sender:
            sender.connect([engine.url])
            assert raced == [1] and {t.publication.epoch for p in sender._ranks for t in p.targets} == {2}
            with sender.update("seed91") as update:
                for name, t in random_checkpoint(checkpoint_tensors(cfg), 91):
                    update.push(name, t)
        assert check_weights_equal(engine.url, hf_seed=91)["success"]
    finally:
        engine.close()
