"""Epoch fencing (docs/security.md, "Epochs"; docs/sglang.md, "Fencing") in a REAL sglang 0.5.23 server
with the plugin (``python -m sglang.launch_server``, tp=1, a tiny Qwen3 on the CPU through the
``p2pw_cpu`` platform, its weights published over Mooncake TCP with sglang's own seed flag).

A sender that lost its session while stopped inside a post (its fence check passed; the write goes
out when it resumes) is the window the sender's own fence cannot close. When another controller
takes the torn session over, every rank moves its weights and its delta area to a fresh Mooncake
endpoint under the next epoch and unregisters them from sglang's own engine
(sglang_plugin/fencing.py, rank_epochs.py): the resumed write fails, and every byte stays the second
controller's. A sender that connected at the old epoch follows the new one (begin answers it) and
writes byte-exact. What the server holds is read with sglang's own ``/weights_checker`` checksums and
compared with sglang's own loader's (sglang_plugin/weight_checksums.py).

Without the revocation (``SessionGate`` not awaiting ``host.revoke()``) the first test fails: the late
sender's resumed post lands (the report of the work that added this says so).
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
from types import SimpleNamespace

import pytest

from conftest import require_sglang
from replica_configs import write_config
from sglang_server import start_sglang_server

require_sglang()  # skips without sglang; fails in CI

from p2pweights.control import SglangEngine  # noqa: E402
from p2pweights.control import protocol as p  # noqa: E402
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint  # noqa: E402
from p2pweights.models.engine_layout import EngineLayout  # noqa: E402
from p2pweights.sender import WeightSender  # noqa: E402
from p2pweights.sglang_plugin import fencing  # noqa: E402
from p2pweights.sglang_plugin.weight_checksums import ExpectedChecksums, engine_checksums  # noqa: E402
from p2pweights.transport.peer import wait_stopped  # noqa: E402
from p2pweights.transport.publication import EnginePublication  # noqa: E402

STARTUP_TIMEOUT_S = 900.0  # a shared 2-core host under other suites' load
LATE, SECOND, NEXT = 61, 62, 63  # the seeds of the late sender's and the later updates
CHANGED = (0.03, 1)  # the update after NEXT: 3% of its elements changed, so it goes as deltas

# The late sender: its own process and controller, stopped by itself inside its first post.
LATE_SENDER = textwrap.dedent('''
    import json, os, signal, sys, time
    from p2pweights.control import SglangEngine
    from p2pweights.errors import P2PWeightsError
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
    from p2pweights.sender import WeightSender
    from p2pweights.transport import mooncake

    cfg, url, seed, go = sys.argv[1:5]
    def say(**kw):
        print(json.dumps(kw), flush=True)
    real_post, posts = mooncake.MooncakeBackend.post, []
    def post(self, engine, local, remote, lengths):
        posts.append(engine)
        if len(posts) == 1:  # its fence check passed: the write goes out when it resumes
            say(event="writing")
            os.kill(os.getpid(), signal.SIGSTOP)
        return real_post(self, engine, local, remote, lengths)
    mooncake.MooncakeBackend.post = post
    sender = WeightSender(cfg, transport="mooncake", buffer_size=1 << 20)
    sender.connect([SglangEngine(url, name="late", timeout=120)])
    items = list(random_checkpoint(checkpoint_tensors(cfg), int(seed)))
    say(event="ready", peer=[t.publication.peer for r in sender._ranks for t in r.targets])
    while not os.path.exists(go):
        time.sleep(0.005)
    try:
        with sender.update(f"seed{seed}") as update:
            for name, t in items:
                update.push(name, t)
        say(event="done")
    except P2PWeightsError as e:
        say(event="failed", error=str(e)[:2000])
    os._exit(0)
''')


class LateSender:
    def __init__(self, cfg: str, url: str, seed: int, go: str):
        self.proc = subprocess.Popen([sys.executable, "-c", LATE_SENDER, cfg, url, str(seed), go],
                                     stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "P2PW_SESSION_LEASE": "2"})  # it asks a 2 s lease
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def next_event(self, timeout: float = 300.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            if line is None:
                raise RuntimeError(f"the late sender exited ({self.proc.poll()})")
            try:
                return json.loads(line)
            except ValueError:
                continue

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def seeded(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang_fencing")
    model_dir = write_config("qwen3", str(root))
    server = start_sglang_server(model_dir, str(root / "server.log"), tp=1, seed_via_mooncake=True)
    sender = None
    try:
        server.wait_healthy(timeout=STARTUP_TIMEOUT_S)
        engine = SglangEngine(server.url, name="sglang-fencing", timeout=120)
        sender = WeightSender(model_dir, transport="mooncake", buffer_size=1 << 20)
        sender.connect([engine])  # epoch 1's publication, before any takeover
        yield SimpleNamespace(server=server, model_dir=model_dir, engine=engine, sender=sender, root=root)
    finally:
        if sender is not None:
            sender.close()
        server.stop()


_EXPECTED: dict[tuple, dict[str, str]] = {}


def expected(model_dir: str, seed: int, changed: tuple[float, int] | None = None) -> dict[str, str]:
    """Each parameter's checksum once sglang's own loader took ``random_checkpoint(.., seed, changed)``."""
    if (seed, changed) not in _EXPECTED:
        _EXPECTED[seed, changed] = ExpectedChecksums(model_dir, EngineLayout.parse("tp=1")).of(seed, changed)[0]
    return _EXPECTED[seed, changed]


def held(engine: SglangEngine) -> dict[str, str]:
    return engine_checksums(engine)[0]


def weight_update(seeded) -> dict:
    """The session's state, without the engine's process name (``instance``: tests/test_engine_set.py)."""
    state = seeded.server.get_json("/server_info")["p2pw_weight_update"]
    return {k: v for k, v in state.items() if k != "instance"}


def publication(seeded) -> EnginePublication:
    return EnginePublication.from_json(seeded.engine.transfer_engine_info(0))


def update(sender: WeightSender, model_dir: str, seed: int, changed: tuple[float, int] | None = None):
    with sender.update(f"seed{seed}" + (f"+{changed[1]}" if changed else "")) as u:
        for name, t in random_checkpoint(checkpoint_tensors(model_dir), seed, changed=changed):
            u.push(name, t)
    assert [e.state for e in u.report.engines] == ["ok"], u.report
    return u.report


def differing(got: dict[str, str], want: dict[str, str]) -> list[str]:
    return sorted(n for n in want if got.get(n) != want[n])


def test_a_sender_stopped_inside_a_post_lands_nothing_after_a_takeover_revoked_its_epoch(seeded):
    info = seeded.engine.server_info()
    assert fencing.OFFER in info["p2pw_plugin"]["offers"], info["p2pw_plugin"]
    before, old = info["p2pw_weight_update"]["epoch"], publication(seeded)
    assert old.epoch == before == 1 and old.delta_area is not None, old
    late_bytes, second = expected(seeded.model_dir, LATE), expected(seeded.model_dir, SECOND)
    assert all(late_bytes[n] != second[n] for n in second)  # every tensor would show the late sender's bytes

    go = str(seeded.root / "go")
    late = LateSender(seeded.model_dir, seeded.server.url, LATE, go)
    try:
        assert late.next_event()["peer"] == [old.peer]
        open(go, "w").close()
        assert late.next_event()["event"] == "writing"
        wait_stopped(late.proc.pid, timeout=60)
        stopped_at = time.monotonic()
        while weight_update(seeded)["state"] == "open" and time.monotonic() - stopped_at < 60:
            time.sleep(0.2)  # its 2 s lease lapses: torn
        assert weight_update(seeded)["state"] == p.TORN, weight_update(seeded)

        with WeightSender(seeded.model_dir, transport="mooncake", buffer_size=1 << 20) as other:
            other.connect([SglangEngine(seeded.server.url, name="second", timeout=120)])  # still epoch 1's
            update(other, seeded.model_dir, SECOND)  # takes over: the ranks move to a new epoch first
            assert {t.publication.epoch for r in other._ranks for t in r.targets} == {before + 1}
        assert weight_update(seeded) == {"state": "none", "epoch": before + 1}
        now = publication(seeded)
        assert now.epoch == before + 1 and now.peer != old.peer, (old.peer, now.peer)
        assert now.params == old.params and now.delta_area == old.delta_area  # the same memory, a new endpoint
        assert differing(held(seeded.engine), second) == []

        open(go + ".resume", "w").close()
        late.proc.send_signal(signal.SIGCONT)  # its post goes out, to the revoked epoch's endpoint
        result = late.next_event()
        assert result["event"] == "failed", result
        late.proc.wait(60)
        time.sleep(1.0)  # anything still on the wire has landed by now
        landed = differing(held(seeded.engine), second)
        assert landed == [], f"{len(landed)} tensors hold the late sender's bytes: {landed[:5]}"
    finally:
        late.close()


def test_a_sender_connected_before_the_takeover_follows_the_new_epoch_byte_exact(seeded):
    """The module's sender connected at epoch 1: its begin answers the new epoch, so it re-fetches the
    publication and re-attaches before writing; the epoch stays while sessions end cleanly."""
    epoch = weight_update(seeded)["epoch"]
    assert epoch >= 2, "runs after the takeover above"
    stale = {t.publication.epoch for r in seeded.sender._ranks for t in r.targets}
    assert stale == {1}, stale
    update(seeded.sender, seeded.model_dir, NEXT)
    assert {t.publication.epoch for r in seeded.sender._ranks for t in r.targets} == {epoch}
    assert {t.publication.peer for r in seeded.sender._ranks for t in r.targets} == {publication(seeded).peer}
    assert differing(held(seeded.engine), expected(seeded.model_dir, NEXT)) == []
    report = update(seeded.sender, seeded.model_dir, NEXT, CHANGED)  # deltas now: the area moved with the weights
    assert report.delta_reason == {} and report.bytes_written < report.bytes, report.delta_reason
    assert differing(held(seeded.engine), expected(seeded.model_dir, NEXT, CHANGED)) == []
    assert weight_update(seeded) == {"state": "none", "epoch": epoch}  # no takeover, no revocation
    assert seeded.engine.weight_version() == f"seed{NEXT}+{CHANGED[1]}"


@pytest.mark.parametrize("delay_s", [0.0, 0.3])
def test_a_late_sender_resumed_while_the_takeover_revokes_lands_nothing_after_it(seeded, delay_s):
    """The late sender is resumed *during* the takeover (its begin revoking, or its writes going out),
    not after it: whatever the interleaving, once the takeover's update returns the engine holds its
    bytes, and nothing of the late sender's lands later (the revocation cut what it had posted)."""
    late_seed, taker_seed = 64 + int(delay_s * 10), 70 + int(delay_s * 10)
    epoch = weight_update(seeded)["epoch"]
    second = expected(seeded.model_dir, taker_seed)
    go = str(seeded.root / f"go-{late_seed}")
    late = LateSender(seeded.model_dir, seeded.server.url, late_seed, go)
    try:
        late.next_event()
        open(go, "w").close()
        assert late.next_event()["event"] == "writing"
        wait_stopped(late.proc.pid, timeout=60)
        stopped_at = time.monotonic()
        while weight_update(seeded)["state"] == "open" and time.monotonic() - stopped_at < 60:
            time.sleep(0.2)
        assert weight_update(seeded)["state"] == p.TORN, weight_update(seeded)
        outcome: list = []
        with WeightSender(seeded.model_dir, transport="mooncake", buffer_size=1 << 20) as other:
            other.connect([SglangEngine(seeded.server.url, name="taker", timeout=120)])
            taker = threading.Thread(target=lambda: outcome.append(update(other, seeded.model_dir, taker_seed)))
            taker.start()
            time.sleep(delay_s)
            open(go + ".resume", "w").close()
            late.proc.send_signal(signal.SIGCONT)  # mid-takeover
            taker.join(300)
        assert outcome, "the takeover's update did not finish"
        assert weight_update(seeded) == {"state": "none", "epoch": epoch + 1}
        late.next_event()  # it failed, or its writes were overwritten: the bytes below decide
        late.proc.wait(60)
        time.sleep(1.0)
        landed = differing(held(seeded.engine), second)
        assert landed == [], f"{len(landed)} tensors hold the late sender's bytes: {landed[:5]}"
    finally:
        late.close()


def test_a_resume_of_released_memory_republishes_under_a_new_epoch_and_the_sender_follows(seeded):
    """Colocated RL releases the weights' memory while it trains: no begin while released, and the
    resume moves every rank to a new epoch (the old endpoint closed) before anyone may write; the
    module's sender follows it at its next begin and writes byte-exact."""
    from p2pweights.control import http
    from p2pweights.errors import EngineError

    epoch, old = weight_update(seeded)["epoch"], publication(seeded)
    controller = SglangEngine(seeded.server.url, name="colocated", timeout=120)
    controller.pause_generation()
    status, answer = http.request("POST", seeded.server.url, "/release_memory_occupation", body={}, timeout=120)
    assert p.ok(status), answer
    with pytest.raises(EngineError, match="resume_memory_occupation"):
        update(seeded.sender, seeded.model_dir, 80)
    status, answer = http.request("POST", seeded.server.url, "/resume_memory_occupation", body={}, timeout=120)
    assert p.ok(status), answer
    assert weight_update(seeded)["epoch"] == epoch + 1
    now = publication(seeded)
    assert now.epoch == epoch + 1 and now.peer != old.peer and now.params == old.params
    update(seeded.sender, seeded.model_dir, 81)
    assert {t.publication.epoch for r in seeded.sender._ranks for t in r.targets} == {epoch + 1}
    assert differing(held(seeded.engine), expected(seeded.model_dir, 81)) == []


# -- the publication's hooks, in this process ------------------------------------------------------
def _session_request(self, method, url, params=None, data=None, headers=None, cookies=None, files=None, auth=None,
                     timeout=None, allow_redirects=True, proxies=None, hooks=None, stream=None, verify=None, cert=None,
                     json=None):
    return json  # requests' Session.request signature: what would be sent


def test_only_the_ranks_registration_put_carries_its_epoch():
    from p2pweights.sglang_plugin import bootstrap_requests, rank_deltas, rank_epochs

    put = f"http://h{rank_deltas.REGISTER_PATH}"
    assert bootstrap_requests.around_session_request(_session_request, None, "PUT", put, json={"a": 1}) == {"a": 1}
    token = rank_epochs._PUBLISHING.set(3)
    try:
        assert bootstrap_requests.around_session_request(_session_request, None, "PUT", put, json={"a": 1}) == {"a": 1,
                                                                                                         "epoch": 3}
        assert bootstrap_requests.around_session_request(_session_request, None, "GET", "http://h/x", json={"a": 1}) == {
            "a": 1}
    finally:
        rank_epochs._PUBLISHING.reset(token)


def test_the_bootstrap_server_keeps_an_accepted_epoch_and_refuses_a_malformed_one(monkeypatch):
    import asyncio

    from p2pweights.sglang_plugin import delta_updates

    monkeypatch.setattr(delta_updates, "AREAS", {})
    monkeypatch.setattr(delta_updates, "EPOCHS", {})

    async def sglang_app(scope, receive, send):  # the bootstrap server: accepts the PUT, answers the GET
        await receive()
        body = json.dumps({"rank": 0, "remote_instance_transfer_engine_info": ["peer", {}]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"1")]})
        await send({"type": "http.response.body", "body": body})

    def call(method, path, body=b""):
        sent = []

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": method, "path": path, "query_string": b"rank=0"}
        asyncio.run(delta_updates.AreaBook(sglang_app)(scope, receive, send))
        return json.loads(sent[1]["body"])

    def put(**keys):
        call("PUT", delta_updates.rank_deltas.REGISTER_PATH,
             json.dumps({"tp_rank": 0, "transfer_engine_info": {}, **keys}).encode())

    put(epoch=2)
    assert call("GET", delta_updates.GET_PATH)["epoch"] == 2 and delta_updates.EPOCHS == {0: 2}
    for forged in (True, -1, 0, "3", 2.5):
        put(epoch=forged)  # not an epoch: the rank's session is not revocable any more
        assert delta_updates.EPOCHS == {} and "epoch" not in call("GET", delta_updates.GET_PATH), forged
        put(epoch=2)
    assert EnginePublication.from_json(call("GET", delta_updates.GET_PATH)).epoch == 2
