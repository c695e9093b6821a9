"""update(verify=True): engine ranks digest what they hold for every written parameter and the sender
compares with what it wrote, before the engines resume. Real receiver processes over Mooncake (and
NIXL); the corruption is one byte flipped in a rank's parameter memory, through Mooncake, after the
writes and before the digest."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from engine_proxy import PosingAs
from p2pweights.control import SglangEngine
from p2pweights.control.weights_digest import ROW_WORDS, digest, parameter_digests
from p2pweights.errors import EngineError, UpdateFailed
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
from p2pweights.receiver import ReceiverServer, check_weights_equal, start_engines
from p2pweights.sender import WeightSender
from p2pweights.sender import verify as update_module  # verify_update calls verify_written
from p2pweights.transport.publication import EnginePublication
from replica_configs import write_config

# ---- the digest ------------------------------------------------------------------------------------------


def test_the_digest_changes_with_any_one_flipped_byte_and_with_moved_words():
    data = torch.randint(0, 256, (4099,), dtype=torch.uint8)  # a tail that is not a whole word
    d = digest(data)
    for i in (0, 7, 8, 2047, 4096, 4098):
        for bit in (0, 7):
            flipped = data.clone()
            flipped[i] ^= 1 << bit
            assert digest(flipped) != d, (i, bit)
    swapped = data.clone()
    swapped[:8], swapped[8:16] = data[8:16].clone(), data[:8].clone()
    assert digest(swapped) != d or torch.equal(data[:8], data[8:16])
    # any dtype, any alignment: the bytes are what count
    as_bf16 = data[:4098].view(torch.bfloat16)
    assert digest(as_bf16) == digest(data[:4098].clone())
    assert digest(data[1:]) == digest(data[1:].clone())


def test_the_digest_sums_wrap_like_the_words_they_add():
    k = ROW_WORDS
    n = 3 * k + 5  # several rows and a partial one; every sum wraps
    words = torch.full((n,), -1, dtype=torch.int64)
    m = (1 << 64) - 1
    s = sum(m for _ in range(n)) % (1 << 64)
    r = sum(m * (i // k + 1) for i in range(n)) % (1 << 64)
    c = sum(m * (i % k + 1) for i in range(n)) % (1 << 64)
    assert digest(words) == f"{s:016x}{r:016x}{c:016x}"
    # a word moved within its row, or to the same column of another row, changes the digest
    data = torch.arange(n, dtype=torch.int64)
    d = digest(data)
    within, across = data.clone(), data.clone()
    within[[3, 9]] = within[[9, 3]]
    across[[3, k + 3]] = across[[k + 3, 3]]
    assert digest(within) != d and digest(across) != d


def test_a_parameter_laid_out_mn_major_is_digested_as_its_bytes_lie_in_memory():
    """A parameter stored as a permutation of its dimensions (sglang's Blackwell packed UE8M0 scales:
    int32, strides (1, N)) is digested in memory order, the bytes a sender writes from its address,
    never a logical-order copy; a view with holes keeps its logical order."""
    storage = torch.arange(6 * 4, dtype=torch.int32).reshape(6, 4)
    mn_major = storage.t()  # shape (4, 6), strides (1, 4): the memory is `storage`
    model = torch.nn.Module()
    model.scale = torch.nn.Parameter(mn_major, requires_grad=False)
    assert not model.scale.is_contiguous()
    got = parameter_digests(model, ["scale"])["scale"]
    assert got == digest(storage.reshape(-1).view(torch.uint8))
    assert got != digest(mn_major.contiguous().reshape(-1).view(torch.uint8))


# ---- real engines ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_config("qwen3", str(tmp_path_factory.mktemp("configs")))


@pytest.fixture(scope="module")
def engine(model):
    (e,) = start_engines(model, "tp=2", count=1, transport="mooncake", name_prefix="verify")
    yield e
    e.close()


def _push(sender, version, seed, specs, **kw):
    with sender.update(version, **kw) as update:
        for name, t in random_checkpoint(specs, seed):
            update.push(name, t)
    return update


def _flip_one_byte(url: str, rank: int, param: str) -> None:
    """Flip the first byte of ``param`` in engine rank ``rank``'s memory, through Mooncake (as any
    process that reaches the rank's transfer engine could)."""
    from p2pweights.transport.mooncake import new_engine

    pub = EnginePublication.from_json(SglangEngine(url).transfer_engine_info(rank))
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


def _flipping_before(verify, url: str, rank: int, param: str):
    """``verify`` run after flipping a byte of ``param`` on ``rank``: after every write returned,
    before the digests."""
    def corrupt_then_verify(*args, **kwargs):
        _flip_one_byte(url, rank, param)
        return verify(*args, **kwargs)

    return corrupt_then_verify


def test_verify_passes_on_a_good_update(model, engine):
    specs = checkpoint_tensors(model)
    sender = WeightSender(model, transport="mooncake", buffer_size=1 << 20)
    try:
        sender.connect([SglangEngine(engine.url, name=engine.name)])
        update = _push(sender, "v1", 1, specs, verify=True)
        assert update.verify_seconds > 0
        assert all(e.state == "ok" for e in update.report.engines)
        assert SglangEngine(engine.url).weight_version() == "v1"
        assert check_weights_equal(engine.url, hf_seed=1)["success"]
    finally:
        sender.close()


def test_one_flipped_byte_fails_the_update_naming_rank_and_parameter_and_the_engine_stays_paused(
        model, engine, monkeypatch):
    specs = checkpoint_tensors(model)
    target = "model.layers.1.mlp.down_proj.weight"
    real_verify = update_module.verify_written
    corrupt_then_verify = _flipping_before(real_verify, engine.url, 1, target)
    sender = WeightSender(model, transport="mooncake", buffer_size=1 << 20)
    client = SglangEngine(engine.url, name=engine.name)
    try:
        sender.connect([client])
        before = client.weight_version()
        monkeypatch.setattr(update_module, "verify_written", corrupt_then_verify)
        with pytest.raises(UpdateFailed) as info:
            _push(sender, "v2", 2, specs, verify=True)
        e = info.value
        assert (e.engine, e.rank, e.parameter) == (engine.name, 1, target)
        assert list(e.failures) == [f"{engine.name}/rank1"]  # rank 0 holds what was written
        assert "1 of" in str(e) and target in str(e)
        # not resumed: old version, session still open (nothing ended it), weights not what v2 wrote
        assert client.weight_version() == before
        with pytest.raises(EngineError):
            client.update_weight_version("v2")
        assert not check_weights_equal(engine.url, hf_seed=2)["success"]

        # the next complete, verified update heals the engine
        monkeypatch.setattr(update_module, "verify_written", real_verify)
        _push(sender, "v3", 3, specs, verify=True)
        assert client.weight_version() == "v3"
        assert check_weights_equal(engine.url, hf_seed=3)["success"]
    finally:
        sender.close()


def test_a_verify_failure_after_an_update_that_wrote_nothing_never_resumes_the_engine(model, engine, monkeypatch):
    # the same checkpoint again: every delta record is empty, no slot reaches the writer; the byte
    # flipped behind the sender's back is caught by the digests, and the engine must stay paused
    # (the session left open), not be rolled back into serving memory known to differ
    specs = checkpoint_tensors(model)
    target = "model.layers.0.mlp.down_proj.weight"
    real_verify = update_module.verify_written
    corrupt_then_verify = _flipping_before(real_verify, engine.url, 0, target)
    sender = WeightSender(model, transport="mooncake", buffer_size=1 << 20)
    client = SglangEngine(engine.url, name=engine.name)
    try:
        sender.connect([client])
        _push(sender, "w1", 4, specs, verify=True)
        monkeypatch.setattr(update_module, "verify_written", corrupt_then_verify)
        with pytest.raises(UpdateFailed) as info:
            _push(sender, "w2", 4, specs, verify=True)
        assert info.value.parameter == target and "stay paused with their session open" in str(info.value)
        assert client.weight_version() == "w1"
        with pytest.raises(EngineError):  # the session is still open: nobody else may version it
            client.update_weight_version("w2")
        monkeypatch.setattr(update_module, "verify_written", real_verify)
        _push(sender, "w3", 4, specs, verify=True)  # full again (the failed update dropped the base): healed
        assert client.weight_version() == "w3"
        assert check_weights_equal(engine.url, hf_seed=4)["success"]
    finally:
        sender.close()


def test_without_verify_the_flipped_byte_goes_unnoticed(model, engine, monkeypatch):
    """What verify=True is for: the same corruption, unverified, is served as the new version."""
    from p2pweights.control import UpdateSession

    specs = checkpoint_tensors(model)
    real_commit = UpdateSession.commit

    def corrupt_then_commit(session):  # after every write returned, before the session ends
        _flip_one_byte(engine.url, 0, "model.norm.weight")
        return real_commit(session)

    sender = WeightSender(model, transport="mooncake", buffer_size=1 << 20)
    client = SglangEngine(engine.url, name=engine.name)
    try:
        sender.connect([client])
        monkeypatch.setattr(UpdateSession, "commit", corrupt_then_commit)
        _push(sender, "v4", 4, specs, verify=False)
        assert client.weight_version() == "v4"
        assert not check_weights_equal(engine.url, hf_seed=4)["success"]
    finally:
        sender.close()


class _NoDigest(PosingAs):
    """An engine that serves the real engine's info but not /p2pw_weights_digest (as sglang 0.5.23)."""

    def transfer_engine_info(self, rank: int):
        return self.real.transfer_engine_info(rank)["remote_instance_transfer_engine_info"]


def test_verify_is_refused_before_pausing_an_engine_that_cannot_digest(model, engine):
    server = ReceiverServer(_NoDigest(engine.url)).start()
    sender = WeightSender(model, transport="mooncake", buffer_size=1 << 20)
    try:
        sender.connect([SglangEngine(server.url, name="sglang-like")])
        with pytest.raises(EngineError, match=r"verify=True needs every engine.*sglang-like.*501") as info:
            sender.update("v5", verify=True)
        assert info.value.engine == "sglang-like" and "verify=False" in str(info.value)
        assert not server.paused and not server.updating
    finally:
        sender.close()
        server.close()


def test_an_sglang_server_without_the_digest_route_is_refused_naming_it():
    """sglang 0.5.23 answers 404 (FastAPI's {"detail": "Not Found"}) for a route it does not have."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from p2pweights.sender.verify import check_engines_digest

    class NotFound(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - BaseHTTPRequestHandler's name
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.dumps({"detail": "Not Found"}).encode()
            self.send_response(404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        with pytest.raises(EngineError, match=r"sglang-0.*HTTP 404.*sglang 0.5.23 cannot") as info:
            check_engines_digest([SglangEngine(f"http://127.0.0.1:{httpd.server_address[1]}", name="sglang-0")])
        assert info.value.engine == "sglang-0"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_p2pw_verify_is_the_default(model, engine, monkeypatch):
    server = ReceiverServer(_NoDigest(engine.url)).start()
    monkeypatch.setenv("P2PW_VERIFY", "1")
    sender = WeightSender(model, transport="mooncake", buffer_size=1 << 20)
    try:
        sender.connect([SglangEngine(server.url, name="sglang-like")])
        with pytest.raises(EngineError, match="verify=True"):
            sender.update("v6")
        assert not server.paused
    finally:
        sender.close()
        server.close()


def test_verify_over_nixl_catches_nothing_on_a_good_update(model):
    (e,) = start_engines(model, "tp=1", count=1, transport="nixl", name_prefix="verify-nixl")
    sender = WeightSender(model, transport="nixl", buffer_size=1 << 20)
    try:
        sender.connect([SglangEngine(e.url, name=e.name)])
        _push(sender, "v1", 1, checkpoint_tensors(model), verify=True)
        assert SglangEngine(e.url).weight_version() == "v1"
    finally:
        sender.close()
        e.close()
