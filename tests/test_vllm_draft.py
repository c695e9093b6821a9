"""A real sender updates a stand-in vLLM 0.33 engine that runs vLLM's MTP drafter (``--speculative-config
'{"method": "mtp"}'``): one session writes the target and the draft, one version labels both.

The engine's worker builds DeepSeek-V3's target and its MTP draft as vLLM does (``cpu_worker.build_draft``:
the draft's own model class, ``load_weights`` and post-processing, then vLLM's proposer methods hand it the
target's embedding and LM head). At ``/init_weight_transfer_engine`` the gate has the worker hand its
drafter to the backend (vLLM's ``_set_draft_weight_update_target``), which registers the draft's own
parameters beside the target's, published as ``draft.<name>``; every finish post-processes both.

The config is DeepSeek-V3 tiny with dense MLPs (``moe_layer_freq`` past every layer, the MTP layer's
too): vLLM's CPU MoE post-processing needs CPU kernels the CUDA wheel installed here lacks, and would
repack the experts. MLA attention (vLLM's reference CPU MLA backend, whose ``W_UV`` / ``W_UK_T`` are
views into ``kv_b_proj``: not published, ``rank_memory.owned_parameters``) and the MTP layer are
DeepSeek-V3's. The bytes are judged by p2pweights' parameter digests of every published parameter,
target and draft, against a fresh vLLM load of each checkpoint in another process."""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest

from test_vllm_backend import STARTUP, Engine  # noqa: E402 (skips without vLLM)
from test_vllm_sender import CHANGED, CORRUPT, SenderProcess, standin  # noqa: E402

FLIPPED_HF = "model.layers.2.enorm.weight"  # the MTP layer's norm: its bytes as they are, in the draft
FLIPPED = "draft." + FLIPPED_HF
SHARED = ("draft.model.embed_tokens.weight", "draft.model.layers.2.shared_head.head.weight", "draft.lm_head.weight")

REFERENCE = r'''
import json, os, sys
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import torch
from vllm.config import set_current_vllm_config
from p2pweights.control.weights_digest import parameter_digests
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
from p2pweights.vllm_backend import cpu_worker
from p2pweights.vllm_backend.rank_memory import ServedModels, owned_parameters
cfg, dist_port, wanted, tp, rank = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
vc = cpu_worker.engine_config(cfg, tp, "mtp")
target = cpu_worker.build_model(vc, cfg, wanted[0][0], dist_port, rank=rank)
draft = cpu_worker.build_draft(vc, cfg, wanted[0][0], target)
served = ServedModels(target, vc.model_config, draft, vc.speculative_config.draft_model_config)
names = [n for n, _ in owned_parameters(served.named_parameters())]  # what the engine publishes
out_digests = []
for seed, changed in wanted:  # a fresh load of each checkpoint: every parameter loaded, then post-processed
    ckpt = dict(random_checkpoint(checkpoint_tensors(cfg), seed, changed=tuple(changed) if changed else None))
    with set_current_vllm_config(vc):
        # the draft's loader also fills the embedding and head it now shares with the target (its MTP
        # layer's copies, as in vLLM before the proposer shares them); the target's own load then
        # writes its own over them, as a fresh vLLM load ends up
        draft.load_weights(iter(ckpt.items()))
        target.load_weights(iter(ckpt.items()))
        served.post_process(torch.device("cpu"))
    out_digests.append(parameter_digests(served, names))
print(json.dumps(out_digests), file=out, flush=True)
'''


def start_references(cfg: str, wanted: list, tp: int = 1) -> list[subprocess.Popen]:
    """Fresh loads of target and draft per checkpoint, one process per TP rank in their own gloo group."""
    port = _free_port()
    return [subprocess.Popen([sys.executable, "-c", REFERENCE, cfg, str(port), json.dumps(wanted), str(tp), str(rank)],
                             stdout=subprocess.PIPE, text=True) for rank in range(tp)]


def read_references(procs: list[subprocess.Popen]) -> list[list[dict[str, str]]]:
    """Per TP rank, per wanted checkpoint: name -> digest."""
    out = []
    for proc in procs:
        text, _ = proc.communicate(timeout=STARTUP)
        assert proc.returncode == 0, proc.returncode
        out.append(json.loads(text.strip().splitlines()[-1]))
    return out


def write_dense_dsv3(root: str) -> str:
    """DeepSeek-V3 tiny (MLA, one MTP layer) with dense MLPs everywhere (module docstring)."""
    from p2pweights.models import load_config

    config = {k: v for k, v in load_config("deepseek-v3-fp8-tiny").items() if k != "quantization_config"}
    config["moe_layer_freq"] = 1000  # no layer index is a multiple: every layer, the MTP one too, is dense
    path = os.path.join(root, "dsv3_dense_mtp")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


class DraftEngine(Engine):
    def digests(self, names: list[str], rank: int = 0) -> dict[str, str]:
        status, answer = self.call("POST", "/p2pw_weights_digest", {"names": {str(rank): names}})
        assert status == 200, answer
        return answer["ranks"][str(rank)]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_draft_cfg")
    with standin(write_dense_dsv3(str(root)), root, "vllm-mtp", DraftEngine, spec="mtp") as running:
        yield running


def published_names(engine: DraftEngine, rank: int = 0) -> list[str]:
    status, pub = engine.call("GET", "/remote_instance_transfer_engine_info", params={"rank": rank})
    assert status == 200, pub
    return list(pub["remote_instance_transfer_engine_info"][1])


def test_the_engine_publishes_its_drafts_own_parameters_beside_the_targets(engine):
    names = published_names(engine)
    draft = [n for n in names if n.startswith("draft.")]
    assert FLIPPED in draft and "draft.model.layers.2.eh_proj.weight" in draft, draft
    assert "draft.model.layers.2.mtp_block.self_attn.kv_b_proj.weight" in draft, draft
    # the embedding and LM head vLLM's MTP drafter takes from the target are the target's only
    assert not set(SHARED) & set(names) and "model.embed_tokens.weight" in names and "lm_head.weight" in names
    # MLA's W_UV / W_UK_T are views into kv_b_proj here (vLLM's CPU MLA): they follow its writes, unpublished
    assert not [n for n in names if n.endswith(("W_UV", "W_UK_T"))], names
    # vLLM's own draft session runs through the gate: start, finish (both post-processed), resume
    owner = secrets.token_urlsafe(24)
    assert engine.call("POST", "/pause", owner=owner)[0] == 200
    before = engine.digests(draft)
    status, answer = engine.call("POST", "/start_draft_weight_update", owner=owner)
    assert status == 200, answer
    status, answer = engine.call("POST", "/finish_weight_update", {}, owner=owner)
    assert status == 200, answer
    assert engine.call("POST", "/resume", owner=owner)[0] == 200
    assert engine.digests(draft) == before  # post-processing again keeps what was loaded


def test_one_update_writes_target_and_draft_verifies_both_and_sends_deltas_after(engine):
    wanted = [[2, None], [3, None], [3, CHANGED]]
    ref_procs = start_references(engine.cfg, wanted)
    sender = SenderProcess(engine)
    try:
        connected = sender.connected()
        assert connected == {"event": "connected", "layout": "vllm:tp=1,dtype=bfloat16,spec=mtp", "kind": "vllm"}, \
            connected
        (refs,) = read_references(ref_procs)
        names = published_names(engine)
        assert set(refs[0]) == set(names), set(refs[0]) ^ set(names)
        update = sender.update

        before = engine.digests(names)
        # 1. one full update writes both roles
        done = update("1", 2)
        assert done["ok"] and not done["ranks"][0]["delta"], done
        now = engine.digests(names)
        assert now == refs[0], sorted(n for n in names if now[n] != refs[0][n])[:6]
        assert {n for n in names if n.startswith("draft.") and now[n] != before[n]} >= {
            FLIPPED, "draft.model.layers.2.mtp_block.self_attn.kv_b_proj.weight"}
        assert engine.call("GET", "/weight_info")[1]["weight_version"] == "1"
        # 2. a draft byte flipped after the writes: verify names the draft's parameter, the engine stays paused
        failed = update("2", 3, flip=lambda: flip_one_draft_byte(engine, 3))
        assert not failed["ok"] and failed["error"] == "UpdateFailed" and FLIPPED in failed["message"], failed
        assert engine.call("GET", "/is_paused")[1]["is_paused"] is True
        assert engine.call("GET", "/weight_info")[1]["weight_version"] == "1"
        held = engine.digests(names)
        assert {n for n in names if held[n] != refs[1][n]} == {FLIPPED}
        # 3. the next update heals it; 4. the one after a good commit goes as deltas, draft included
        done = update("3", 3)
        assert done["ok"] and engine.digests(names) == refs[1], done
        done = update("4", 3, changed=CHANGED)
        assert done["ok"] and done["ranks"][0]["delta"] and done["ranks"][0]["written"] < done["ranks"][0]["bytes"] // 4
        now = engine.digests(names)
        assert now == refs[2] != refs[1], sorted(n for n in names if now[n] != refs[2][n])[:6]
        assert engine.call("GET", "/is_paused")[1]["is_paused"] is False
    finally:
        sender.close()
        for proc in ref_procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def _free_port() -> int:
    from test_vllm_backend import free_port

    return free_port()


def flip_one_draft_byte(engine: DraftEngine, seed: int) -> None:
    """One byte of the draft's ``FLIPPED`` made to differ from checkpoint ``seed``'s, by a one-sided
    Mooncake write of a third process."""
    import torch

    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint

    tensor = dict(random_checkpoint(checkpoint_tensors(engine.cfg), seed))[FLIPPED_HF]
    value = int(tensor.contiguous().view(-1).view(torch.uint8)[0]) ^ 0xFF
    status, pub = engine.call("GET", "/remote_instance_transfer_engine_info", params={"rank": 0})
    assert status == 200, pub
    proc = subprocess.run([sys.executable, "-c", CORRUPT, FLIPPED, str(value)], text=True, timeout=300,
                          input=json.dumps(pub) + "\n", stdout=subprocess.PIPE)
    assert proc.returncode == 0 and json.loads(proc.stdout.strip().splitlines()[-1])["status"] == 0, proc.stdout


def test_a_tp2_drafting_engine_publishes_and_takes_each_ranks_draft_shards(tmp_path):
    """tp=2: both workers hand their drafter over at the init (the gate's attach_drafts, all or none);
    each rank publishes its own draft shards; a full and then a delta update equal fresh tp=2 loads."""
    cfg = write_dense_dsv3(str(tmp_path))
    wanted = [[2, None], [2, CHANGED]]
    ref_procs = start_references(cfg, wanted, tp=2)
    try:
        with standin(cfg, tmp_path, "vllm-mtp-tp2", DraftEngine, tp=2, spec="mtp") as engine:
            names = [published_names(engine, r) for r in range(2)]
            assert all(FLIPPED in n and not set(SHARED) & set(n) for n in names), names
            sender = SenderProcess(engine)
            try:
                assert sender.connected()["layout"] == "vllm:tp=2,dtype=bfloat16,spec=mtp"
                refs = read_references(ref_procs)
                kv_b = "draft.model.layers.2.mtp_block.self_attn.kv_b_proj.weight"  # split over the TP ranks
                assert refs[0][0][kv_b] != refs[1][0][kv_b]
                for step, (version, seed, changed) in enumerate((("1", 2, None), ("2", 2, CHANGED))):
                    done = sender.update(version, seed, changed)
                    assert done["ok"] and [r["delta"] for r in done["ranks"]] == [bool(changed)] * 2, done
                    for r in range(2):
                        now = engine.digests(names[r], r)
                        assert now == refs[r][step], (r, sorted(n for n in now if now[n] != refs[r][step][n])[:6])
            finally:
                sender.close()
    finally:
        for proc in ref_procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
