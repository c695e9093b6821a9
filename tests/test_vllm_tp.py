"""A real sender updates a stand-in vLLM 0.33 engine of two tensor-parallel ranks: two worker processes
(``vllm_backend/cpu_worker.py``) in one gloo group, each holding its own rank's shards as vLLM's own
loaders cut them, each registering and publishing its own memory over Mooncake; the API server's
client fans every RPC out to both workers at once and answers in rank order, as vLLM's
``collective_rpc`` does (``vllm_backend/standin_api.py``).

The engine's bytes are judged by vLLM's own ``/weight_checker`` checksums (one key per TP rank and
parameter) against fresh vLLM loads of the same checkpoints at tp=2: two reference processes that
form their own gloo group and load through vLLM's loaders, sharding as the engine's workers do."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from replica_configs import write_config  # noqa: E402
from test_vllm_backend import STARTUP, Engine, free_port  # noqa: E402 (skips without vLLM)
from test_vllm_sender import CHANGED, CORRUPT, FLIPPED, SenderProcess, standin  # noqa: E402

TP = 2

REFERENCE_RANK = r'''
import json, os, sys
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import torch
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
from p2pweights.vllm_backend import cpu_worker
cfg, dist_port, tp, rank, wanted = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
vc = cpu_worker.engine_config(cfg, tp)
model = cpu_worker.build_model(vc, cfg, wanted[0][0], dist_port, rank=rank)
digests = []
for seed, changed in wanted:  # a fresh vLLM load of each checkpoint for this TP rank, as /weight_checker hashes it
    with set_current_vllm_config(vc):
        model.load_weights(random_checkpoint(checkpoint_tensors(cfg), seed, changed=tuple(changed) if changed else None))
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    digests.append(compute_tensor_digests(model))
print(json.dumps(digests), file=out, flush=True)
'''


class TpEngine(Engine):
    def checksums(self) -> dict[str, str]:
        """vLLM's checksums keyed ``tp<rank>:<name>`` (vLLM's own keys: ``dp0:pp0:pcp0:tp<rank>:<name>``)."""
        status, answer = self.call("POST", "/weight_checker", {"action": "checksum"})
        assert status == 200, answer
        return {k.split(":", 3)[-1]: v for k, v in answer["checksums"].items()}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_tp_cfg")
    with standin(write_config("qwen3", str(root)), root, "vllm-tp2", TpEngine, tp=TP) as running:
        yield running


def start_references(cfg: str, wanted: list) -> list[subprocess.Popen]:
    """TP reference processes, one per rank, in their own gloo group (started now, read later)."""
    port = free_port()
    return [subprocess.Popen([sys.executable, "-c", REFERENCE_RANK, cfg, str(port), str(TP), str(rank),
                              json.dumps(wanted)], stdout=subprocess.PIPE, text=True) for rank in range(TP)]


def read_references(procs: list[subprocess.Popen]) -> list[dict[str, str]]:
    """Per wanted checkpoint: ``tp<rank>:<name>`` -> vLLM's digest of that rank's fresh load."""
    per_rank = []
    for proc in procs:
        out, _ = proc.communicate(timeout=STARTUP)
        assert proc.returncode == 0, proc.returncode
        per_rank.append(json.loads(out.strip().splitlines()[-1]))
    return [{f"tp{rank}:{name}": d for rank, digests in enumerate(per_rank) for name, d in digests[i].items()}
            for i in range(len(per_rank[0]))]


def flip_one_byte_on_rank(engine: TpEngine, rank: int, seed: int) -> None:
    """One byte of ``FLIPPED`` (replicated: every rank holds it whole) made to differ from checkpoint
    ``seed``'s on ``rank`` only, by a one-sided Mooncake write of a third process."""
    import torch

    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint

    tensor = dict(random_checkpoint(checkpoint_tensors(engine.cfg), seed))[FLIPPED]
    value = int(tensor.contiguous().view(-1).view(torch.uint8)[0]) ^ 0xFF
    status, pub = engine.call("GET", "/remote_instance_transfer_engine_info", params={"rank": rank})
    assert status == 200 and pub["rank"] == rank, pub
    proc = subprocess.run([sys.executable, "-c", CORRUPT, FLIPPED, str(value)], text=True, timeout=300,
                          input=json.dumps(pub) + "\n", stdout=subprocess.PIPE)
    assert proc.returncode == 0 and json.loads(proc.stdout.strip().splitlines()[-1])["status"] == 0, proc.stdout


def test_a_sender_updates_a_tp2_vllm_engine_rank_by_rank_verifies_both_and_sends_deltas_after(engine):
    wanted = [[1, None], [2, None], [3, None], [3, CHANGED]]  # seed 1: what the workers loaded at start
    ref_procs = start_references(engine.cfg, wanted)
    sender = SenderProcess(engine)
    try:
        connected = sender.connected()
        assert connected == {"event": "connected", "layout": "vllm:tp=2,dtype=bfloat16", "kind": "vllm"}, connected
        refs = read_references(ref_procs)
        # each rank publishes its own memory; the workers hold shards, not copies of one model
        pubs = [engine.call("GET", "/remote_instance_transfer_engine_info", params={"rank": r})[1] for r in range(TP)]
        peers = [p["remote_instance_transfer_engine_info"][0] for p in pubs]
        assert [p["rank"] for p in pubs] == [0, 1] and peers[0] != peers[1] and all(p["delta_area"] for p in pubs), pubs
        before = engine.checksums()
        assert before == refs[0], "the engine's own tp=2 load differs from the references' (seed 1)"
        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        assert before[f"tp0:{qkv}"] != before[f"tp1:{qkv}"] and before[f"tp0:{FLIPPED}"] == before[f"tp1:{FLIPPED}"]
        update = sender.update

        # 1. a full update of both ranks; verify=True's digests agree on both
        done = update("1", 2)
        assert done["ok"] and len(done["ranks"]) == TP and not any(r["delta"] for r in done["ranks"]), done
        assert engine.checksums() == refs[1] != refs[0]
        # 2. one byte flipped on rank 1 only after the writes: verify names rank 1, the engine stays paused
        failed = update("2", 3, flip=lambda: flip_one_byte_on_rank(engine, 1, 3))
        assert not failed["ok"] and failed["error"] == "UpdateFailed" and FLIPPED in failed["message"], failed
        assert "rank 1" in failed["message"] and "rank 0" not in failed["message"], failed
        assert engine.call("GET", "/is_paused")[1]["is_paused"] is True
        assert engine.call("GET", "/weight_info")[1]["weight_version"] == "1"
        held = engine.checksums()
        assert {k for k in held if held[k] != refs[2][k]} == {f"tp1:{FLIPPED}"}
        # 3. the next update heals it (the base was forgotten: full writes)
        done = update("3", 3)
        assert done["ok"] and not any(r["delta"] for r in done["ranks"]), done
        assert engine.checksums() == refs[2]
        # 4. after a good commit, each rank takes its own deltas into its own delta area
        done = update("4", 3, changed=CHANGED)
        assert done["ok"] and len(done["ranks"]) == TP, done
        for rank in done["ranks"]:
            assert rank["delta"] and rank["written"] < rank["bytes"] // 4, done
        assert engine.checksums() == refs[3] != refs[2]
        assert engine.call("GET", "/weight_info")[1]["weight_version"] == "4"
        assert engine.call("GET", "/is_paused")[1]["is_paused"] is False
    finally:
        sender.close()
        for proc in ref_procs:
            if proc.poll() is None:
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


def test_the_tp2_engine_runs_every_rpc_on_both_workers_at_once_answering_in_rank_order(engine):
    import asyncio
    import threading

    import cloudpickle  # vLLM's run_method takes a pickled function as its method, as vLLM's executors do

    def meet(worker):  # each rank waits for the other in an all-reduce: workers called one by one never return
        import torch
        import torch.distributed as dist
        from vllm.distributed.parallel_state import get_tp_group

        total = torch.tensor([worker.rank + 1])
        dist.all_reduce(total, group=get_tp_group().cpu_group)
        return [worker.rank, int(total)]

    met: list = []  # on a thread: a deadlocked call fails the test instead of hanging it
    runner = threading.Thread(target=lambda: met.append(asyncio.run(engine.client.collective_rpc(
        cloudpickle.dumps(meet)))), daemon=True)
    runner.start()
    runner.join(60)
    assert met == [[[0, 3], [1, 3]]], f"the workers did not meet in one collective RPC within 60 s: {met}"
    answers = asyncio.run(engine.client.collective_rpc("weight_transfer_engine", args=("ping", {})))
    assert [a["rank"] for a in answers] == [0, 1] and answers[0]["pid"] != answers[1]["pid"], answers
    status, world = engine.call("GET", "/get_world_size")
    assert status == 200 and world["world_size"] == TP, world
    status, answer = engine.call("GET", "/remote_instance_transfer_engine_info", params={"rank": TP})
    assert status == 400 and f"rank {TP}" in json.dumps(answer), answer
