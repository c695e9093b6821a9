"""The published per-rank JSON: sglang's Mooncake format exactly, the NIXL format, the safety checks
a sender makes from it, and the transport factory."""
from __future__ import annotations

import json
import socket

import pytest

from conftest import require_sglang
from p2pweights import _native
from p2pweights.errors import LayoutMismatch, UnknownParameter, WrongTransport
from p2pweights.transport import make_backend, make_receiver_endpoint, make_sender_transport, merge_regions
from p2pweights.transport.publication import EnginePublication, ParamTarget, parse_descriptor

TABLE = {"model.embed_tokens.weight": [0x7F0000000000, 1024, 2],
         "model.norm.weight": [0x7F0000000800, 512, 2],          # touches the embedding: merged
         "lm_head.weight": [0x7F0000100000, 4096, 4]}             # apart: its own region


def test_sglang_answer_parses_and_regions_are_the_merged_parameter_ranges():
    # What GET /remote_instance_transfer_engine_info?rank=1 returns (engine_info_bootstrap_server.py).
    answer = {"rank": 1, "remote_instance_transfer_engine_info": ["10.0.0.5:15432", TABLE]}
    pub = EnginePublication.from_json(json.dumps(answer))
    assert pub.transport == "mooncake" and pub.peer == "10.0.0.5:15432" and pub.rank == 1
    assert pub.params["lm_head.weight"] == ParamTarget(0x7F0000100000, 4096, 4)
    assert pub.regions == [(0x7F0000000000, 2048 + 1024), (0x7F0000100000, 4096 * 4)]
    assert json.loads(pub.to_json()) == answer  # our Mooncake receivers publish exactly sglang's format
    assert parse_descriptor(pub.descriptor).peer == "10.0.0.5:15432"
    # sglang's bare [session id, table] pair too
    assert EnginePublication.from_json(answer["remote_instance_transfer_engine_info"]).peer == "10.0.0.5:15432"


def test_nixl_publication_round_trips_with_its_agent_metadata():
    pub = EnginePublication(transport="nixl", peer="agent-7", params={k: ParamTarget(*v) for k, v in TABLE.items()},
                            rank=0, agent_metadata=b"\x00\x01meta\xff", location="cuda:3")
    d = json.loads(pub.to_json())
    assert d["transport"] == "nixl" and d["remote_instance_transfer_engine_info"][0] == "agent-7"
    back = EnginePublication.from_json(d)
    assert back.agent_metadata == b"\x00\x01meta\xff" and back.location == "cuda:3" and back.regions == pub.regions
    desc = parse_descriptor(pub.descriptor)
    assert (desc.transport, desc.peer, desc.agent_metadata, desc.location) == ("nixl", "agent-7", b"\x00\x01meta\xff",
                                                                                "cuda:3")


def test_wrong_transport_names_what_the_engine_published_and_the_flag_that_fixes_it():
    pub = EnginePublication.from_json({"rank": 2, "remote_instance_transfer_engine_info": ["h:1", TABLE]})
    pub.check_transport("mooncake")
    with pytest.raises(WrongTransport) as info:
        pub.check_transport("nixl", engine="engine3")
    msg = str(info.value)
    assert "engine 'engine3' rank 2 published its weights for mooncake" in msg
    assert "P2PW_TRANSPORT=mooncake" in msg


def test_source_bytes_must_equal_numel_times_element_size():
    pub = EnginePublication.from_json({"remote_instance_transfer_engine_info": ["h:1", TABLE]})
    assert pub.target("lm_head.weight", 4096 * 4, engine="e0").data_ptr == 0x7F0000100000
    with pytest.raises(LayoutMismatch, match=r"engine 'e0' parameter 'lm_head.weight'.*8192 bytes.*16384"):
        pub.target("lm_head.weight", 8192, engine="e0")
    with pytest.raises(UnknownParameter, match="e0"):
        pub.target("model.layers.0.mlp.gate_up_proj.weight", 8, engine="e0")


@pytest.mark.parametrize("bad", [{"error": {"message": "Failed to get transfer engine info for rank 0"}},
                                 {"rank": 0, "remote_instance_transfer_engine_info": ["", {}]},
                                 {"rank": 0, "remote_instance_transfer_engine_info": ["h:1", {"w": [1, 2]}]},
                                 {"rank": 0, "transport": "nixl", "remote_instance_transfer_engine_info": ["a", {}]}])
def test_malformed_publications_are_refused(bad):
    with pytest.raises(ValueError):
        EnginePublication.from_json(bad)


def test_publication_must_equal_the_replica_both_ways():
    pub = EnginePublication.from_json(["10.0.0.5:15432", TABLE])
    replica = {name: row[1] * row[2] for name, row in TABLE.items()}
    pub.check_params(replica, engine="e0 rank 1")  # equal: no error
    # published, but not in the replica: one-way checks let this through
    with pytest.raises(LayoutMismatch, match=r"e0 rank 1.*lm_head\.weight: published, but the sender's replica has no"):
        pub.check_params({n: b for n, b in replica.items() if n != "lm_head.weight"}, engine="e0 rank 1")
    with pytest.raises(LayoutMismatch, match=r"model\.layers\.0\.mlp\.weight: not published"):
        pub.check_params({**replica, "model.layers.0.mlp.weight": 64}, engine="e0 rank 1")
    with pytest.raises(LayoutMismatch, match=r"model\.norm\.weight: published 1024 B, the sender's replica has 2048 B"):
        pub.check_params({**replica, "model.norm.weight": 2048}, engine="e0 rank 1", hint="same model and flags?")


def test_merge_regions():
    assert merge_regions([(10, 5), (0, 10), (30, 1), (15, 0), (31, 4), (2, 3)]) == [(0, 15), (30, 5)]


def test_sender_transport_factory():
    assert isinstance(make_sender_transport("loopback"), _native.LoopbackTransport)
    t = make_sender_transport("mooncake")
    assert isinstance(t, _native.PyTransport) and t.name == "mooncake"
    t.close()
    with pytest.raises(ValueError, match="unknown transport"):
        make_sender_transport("nccl")


def test_nixl_plugin_honours_sglang_variable(monkeypatch):
    monkeypatch.delenv("P2PW_NIXL_BACKEND", raising=False)
    monkeypatch.setenv("SGLANG_REMOTE_INSTANCE_NIXL_BACKEND", "POSIX")
    b = make_backend("nixl")
    assert b.plugin == "POSIX"
    b.close()
    monkeypatch.setenv("P2PW_NIXL_BACKEND", "UCX")
    b = make_backend("nixl")
    assert b.plugin == "UCX"
    b.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_real_sglang_bootstrap_server_serves_our_mooncake_publication():
    """Our Mooncake receiver's table, registered the way sglang's model runner does it, comes back
    from sglang's own EngineInfoBootstrapServer as a publication we parse and connect to."""
    require_sglang()
    requests = pytest.importorskip("requests")
    import numpy as np
    from sglang.srt.entrypoints.engine_info_bootstrap_server import EngineInfoBootstrapServer

    region = np.zeros(1 << 20, dtype=np.uint8)
    ep = make_receiver_endpoint("mooncake")
    ep.register(region.ctypes.data, region.nbytes)
    table = {"w": [region.ctypes.data, region.nbytes // 2, 2]}
    port = _free_port()
    server = EngineInfoBootstrapServer("127.0.0.1", port)
    try:
        for _ in range(100):
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
                    break
            except requests.ConnectionError:
                import time

                time.sleep(0.05)
        r = requests.put(f"http://127.0.0.1:{port}/register_transfer_engine_info",
                         json={"tp_rank": 0, "transfer_engine_info": {"session_id": ep.peer,
                                                                      "weights_info_dict": table}}, timeout=5)
        assert r.ok, r.text
        answer = requests.get(f"http://127.0.0.1:{port}/get_transfer_engine_info", params={"rank": 0}, timeout=5).json()
    finally:
        server.close()
    pub = EnginePublication.from_json(answer)
    assert pub.to_dict() == ep.publication(table, rank=0).to_dict() == answer
    t = make_sender_transport("mooncake")
    try:
        t.connect(0, pub.descriptor)  # the peer is reachable from what sglang served
    finally:
        t.close()
        ep.close()
