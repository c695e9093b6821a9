"""A real sender updates a stand-in vLLM 0.33 engine of two data-parallel ranks (``--data-parallel-size
2``, tp=1, a dense model): two worker processes, each its own engine as vLLM runs a dense model's DP
ranks (``EngineCoreProc`` after ``reconfigure_for_independent_dp_rank``, ``data_parallel_index`` kept),
each registering and publishing its own memory as engine rank ``data_parallel_index * tp + rank``.

The layout is read from vLLM's ``/server_info`` (dp=2) and checked against ``/get_world_size`` (2);
the sender writes each DP rank its own copy. vLLM's ``/weight_checker`` keys each DP rank's checksums
``dp<i>:...``; each must equal a fresh tp=1 vLLM load of the checkpoint (a dense DP rank holds the
whole model)."""
from __future__ import annotations

import pytest

from replica_configs import write_config  # noqa: E402
from test_vllm_backend import Engine  # noqa: E402 (skips without vLLM)
from test_vllm_sender import CHANGED, FLIPPED, SenderProcess, references, standin  # noqa: E402
from test_vllm_tp import flip_one_byte_on_rank  # noqa: E402

DP = 2


class DpEngine(Engine):
    def checksums(self) -> dict[str, str]:
        """vLLM's checksums keyed ``dp<i>:<name>`` (vLLM's own keys: ``dp<i>:pp0:pcp0:tp0:<name>``)."""
        status, answer = self.call("POST", "/weight_checker", {"action": "checksum"})
        assert status == 200, answer
        out = {}
        for key, digest in answer["checksums"].items():
            dp, _, _, tp, name = key.split(":", 4)
            assert tp == "tp0", key
            out[f"{dp}:{name}"] = digest
        return out


def per_dp_rank(digests: dict[str, str]) -> dict[str, str]:
    """A tp=1 reference's digests as every DP rank must hold them."""
    return {f"dp{i}:{name}": d for i in range(DP) for name, d in digests.items()}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_dp_cfg")
    with standin(write_config("qwen3", str(root)), root, "vllm-dp2", DpEngine, dp=DP) as running:
        yield running


def test_a_sender_updates_each_dp_rank_of_a_vllm_engine_verifies_each_and_sends_deltas_after(engine):
    wanted = [[2, None], [3, None], [3, CHANGED]]
    sender = SenderProcess(engine)
    try:
        refs = [per_dp_rank(r) for r in references(engine, wanted)]
        connected = sender.connected()
        assert connected == {"event": "connected", "layout": "vllm:tp=1,dp=2,dtype=bfloat16", "kind": "vllm"}, connected
        pubs = [engine.call("GET", "/remote_instance_transfer_engine_info", params={"rank": r})[1] for r in range(DP)]
        assert [p["rank"] for p in pubs] == [0, 1], pubs
        assert pubs[0]["remote_instance_transfer_engine_info"][0] != pubs[1]["remote_instance_transfer_engine_info"][0]
        update = sender.update

        # 1. a full update writes both DP ranks
        done = update("1", 2)
        assert done["ok"] and len(done["ranks"]) == DP and not any(r["delta"] for r in done["ranks"]), done
        assert engine.checksums() == refs[0]
        # 2. one byte flipped on DP rank 1 only: verify names rank 1, the engine stays paused at version 1
        failed = update("2", 3, flip=lambda: flip_one_byte_on_rank(engine, 1, 3))
        assert not failed["ok"] and failed["error"] == "UpdateFailed" and FLIPPED in failed["message"], failed
        assert "rank 1" in failed["message"] and "rank 0" not in failed["message"], failed
        assert engine.call("GET", "/weight_info")[1]["weight_version"] == "1"
        held = engine.checksums()
        assert {k for k in held if held[k] != refs[1][k]} == {f"dp1:{FLIPPED}"}
        # 3. the next update heals it; 4. the one after a good commit goes as deltas on both DP ranks
        done = update("3", 3)
        assert done["ok"] and engine.checksums() == refs[1], done
        done = update("4", 3, changed=CHANGED)
        assert done["ok"] and all(r["delta"] and r["written"] < r["bytes"] // 4 for r in done["ranks"]), done
        assert engine.checksums() == refs[2] != refs[1]
        assert engine.call("GET", "/is_paused")[1]["is_paused"] is False
    finally:
        sender.close()


def test_a_workers_rank_counts_its_dp_rank_once_whether_dp_ranks_share_a_world_or_not(monkeypatch):
    """vLLM indexes ``update_weights`` lists by ``data_parallel_index * world_size + rank``. An MoE
    engine's DP ranks share one world group, whose rank already counts the DP ranks before it."""
    import types

    from vllm.distributed import parallel_state

    from p2pweights.vllm_backend.transfer_engine import worker_rank

    config = types.SimpleNamespace(world_size=2, data_parallel_index=1)  # tp=2, DP rank 1
    monkeypatch.setattr(parallel_state, "_WORLD", types.SimpleNamespace(rank_in_group=1))  # dense: own world
    assert worker_rank(config) == 3
    monkeypatch.setattr(parallel_state, "_WORLD", types.SimpleNamespace(rank_in_group=3))  # MoE: world of dp x tp
    assert worker_rank(config) == 3
