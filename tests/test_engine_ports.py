"""Engines started together (receiver/local.py ``start_together``, which the demos use) survive a
picked port that another process takes before the leader binds it: ports are picked free, then bound
seconds later, after the rank process has imported sglang and made its transport. Real receiver
processes; the port is taken by a real listening socket."""
from __future__ import annotations

import socket

from p2pweights.control import SglangEngine
from p2pweights.receiver import LocalEngine, local, start_together
from replica_configs import write_config


def test_a_taken_port_is_picked_again(tmp_path, monkeypatch):
    cfg = write_config("qwen3", str(tmp_path), hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                       vocab_size=512)
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(1)
    taken = squatter.getsockname()[1]
    picks = []
    real = local.free_port

    def free_port(host: str = "127.0.0.1") -> int:  # the first pick is the port the squatter holds
        picks.append(taken if not picks else real(host))
        return picks[-1]

    monkeypatch.setattr(local, "free_port", free_port)
    engines = [LocalEngine(cfg, "tp=1", name="ports0", transport="mooncake")]
    try:
        start_together(engines)
        assert picks[0] == taken and engines[0].port != taken
        assert SglangEngine(engines[0].url).weight_version() is not None  # the engine answers on its new port
    finally:
        for e in engines:
            e.close()
        squatter.close()


def test_a_port_the_caller_chose_is_kept(tmp_path):
    """A port the caller named is never swapped for another: the error says it is taken."""
    cfg = write_config("qwen3", str(tmp_path), hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                       vocab_size=512)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        port = squatter.getsockname()[1]
        engines = [LocalEngine(cfg, "tp=1", name="ports1", transport="mooncake", port=port)]
        try:
            start_together(engines)
        except Exception as e:  # noqa: BLE001 - the engine's error, checked below
            assert "Address already in use" in str(e) and "ports1" in str(e)
        else:
            raise AssertionError("an engine started on a port another process listens on")
