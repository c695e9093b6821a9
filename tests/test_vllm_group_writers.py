"""Several writers of one vLLM engine rank, in real processes: two trainer ranks in one gloo group
(two PP stages, or two senders of one stage splitting its layers) update the stand-in vLLM engine of
tests/test_vllm_backend.py (vLLM's own worker, routes and the p2pweights gate) over real Mooncake.
Both write deltas into their own part of the rank's delta area and both apply their records beside
their writes (the second under sender 0's owner token); sender 0's end names the rest as segments.
Judged by vLLM's own ``/weight_checker`` checksums against a fresh CPU vLLM load of each version."""
from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest

from replica_configs import write_config  # noqa: E402
from test_vllm_backend import STARTUP, end_child, read_json_line  # noqa: E402 (skips without vLLM)
from test_vllm_sender import references, standin  # noqa: E402

WRITER = r'''
import json, os, sys
out = os.fdopen(os.dup(1), "w")  # the result lines own stdout; what vLLM and Mooncake print goes to stderr
os.dup2(2, 1)
sys.stdout = sys.stderr
import torch.distributed as dist
from p2pweights import WeightSender
from p2pweights.control import VllmEngine
from p2pweights.models import writer_hf_names
from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
cfg, url, key, rank, port, split = sys.argv[1:7]
rank = int(rank)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
how = {"pp_stage": rank, "pp_size": 2} if split == "pp" else {"split": "layers"}
sender = WeightSender(cfg, group=dist.group.WORLD, transport="mooncake", buffer_size=1 << 20, **how)
sender.connect([VllmEngine(url, api_key=key)])
specs = checkpoint_tensors(cfg)
mine = set(writer_hf_names(specs, sender.config["num_hidden_layers"], sender.pp_stage, sender.pp_size,
                           *sender.writer_in_stage()))
print(json.dumps({"event": "connected"}), file=out, flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    changed = tuple(cmd["changed"]) if cmd["changed"] else None
    try:
        with sender.update(version=cmd["version"]) as update:
            update.push_many((n, t) for n, t in random_checkpoint(specs, cmd["seed"], changed=changed) if n in mine)
        r = update.report
        print(json.dumps({"ok": True, "delta": [e.delta for e in r.engines], "reason": r.delta_reason,
                          "bytes": r.bytes, "written": r.bytes_written, "slots": r.slots,
                          "beside": r.apply_calls_beside}), file=out, flush=True)
    except Exception as e:
        print(json.dumps({"ok": False, "error": type(e).__name__, "message": str(e)}), file=out, flush=True)
sender.close()
dist.destroy_process_group()
'''

SEED = 41
STEPS = [None, [0.01, 1], [0.01, 2]]  # a full first update, then two versions with 1% of each tensor changed


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_group_cfg")
    cfg = write_config("qwen3", str(root), hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                       vocab_size=4096)
    with standin(cfg, root, "vllm-writers") as running:
        yield running


@pytest.mark.parametrize("split", ["pp", "layers"])
def test_two_writers_of_a_vllm_rank_write_and_apply_deltas_byte_exact(engine, split):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, engine.cfg, engine.url, engine.key, str(rank), str(port),
                               split], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        refs = references(engine, [[SEED, c] for c in STEPS])  # beside the senders' imports and replica builds
        assert [read_json_line(p, STARTUP) for p in procs] == [{"event": "connected"}] * 2
        beside = [0, 0]
        for step, changed in enumerate(STEPS):
            version = f"{split}{step}"
            for p in procs:
                p.stdin.write(json.dumps({"version": version, "seed": SEED, "changed": changed}) + "\n")
                p.stdin.flush()
            done = [read_json_line(p, 600) for p in procs]
            assert all(d["ok"] for d in done), done
            assert engine.checksums() == refs[step], f"step {step}"
            assert engine.call("GET", "/weight_info")[1]["weight_version"] == version
            for k, d in enumerate(done):
                if changed is None:  # the first update after connect: in full
                    assert d["written"] == d["bytes"] and d["delta"] == [False], d
                    continue
                assert d["delta"] == [True] and d["reason"] == {} and 0 < d["written"] < 0.1 * d["bytes"], d
                assert d["slots"] >= 3, d
                beside[k] += d["beside"]
        assert all(beside), beside  # both writers applied records beside their writes
    finally:
        for p in procs:
            end_child(p)
