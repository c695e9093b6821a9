"""FP8 MoE updates into a vLLM engine on its default Hopper flags, byte-exact at every step (issue 35).

The engine: the stand-in vLLM engine (``vllm_backend/standin_engine.py``) with ``hopper="tp=2,ep=2"``:
two worker processes, each holding what rank r of a Hopper (sm90) engine started with
``--tensor-parallel-size 2 --enable-expert-parallel`` and nothing else (``VLLM_USE_DEEP_GEMM`` unset,
FlashInfer present, ``--moe-backend`` auto) holds for DeepSeek-V3 FP8 tiny: built, loaded and
post-processed by the replica's own reference path under the Hopper stand-in (``cpu_worker
--hopper``), so its FP8 block linears carry DeepGEMM's E8M0-requantized weights and scales and its
experts FlashInfer CUTLASS's w31 order. Each worker registers and publishes that memory through the
``p2pweights`` backend (``weight_transfer_config={"backend": "p2pweights"}``) and its finishes
post-process as that engine's do (inside the rank's vLLM context).

A real sender process reads the layout from vLLM's ``/server_info`` (``vllm:tp=2,ep=2``), replays the
two transforms on send and writes over Mooncake: a full update, then two with 1% of the BF16
elements changed (deltas), each with ``verify=True``. After each, vLLM's own ``/weight_checker``
checksums of both ranks equal vLLM's checksums (``compute_tensor_digests``) of the Hopper stand-in's
fresh load + post-processing of the same checkpoint (``vllm_check.reference_model``), and the
sender's report says how many bytes crossed the transport.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

try:
    import vllm  # noqa: F401
except ImportError as e:
    pytest.skip(f"vllm is not importable ({e}); install vllm 0.33.0 as docs/vllm.md says", allow_module_level=True)

from p2pweights.models import resolve_model  # noqa: E402
from test_vllm_backend import STARTUP, end_child, read_json_line  # noqa: E402
from test_vllm_sender import standin  # noqa: E402
from test_vllm_tp import TpEngine  # noqa: E402

MODEL = "deepseek-v3-fp8-tiny"
HOPPER = "tp=2,ep=2"  # vLLM's defaults otherwise: DeepGEMM linears, FlashInfer CUTLASS experts
ENGINE_SEED = 1       # what the stand-in's workers load at start (StandInVllmEngine)
SEED = 5
FRACTION = 0.01
LINEAR = "model.layers.0.self_attn.o_proj"                 # DeepGEMM's (deepgemm_e8m0)
EXPERTS = "model.layers.1.mlp.experts.routed_experts"      # FlashInfer CUTLASS's (flashinfer_cutlass_w31)

SENDER = r'''
import json, os, sys
out = os.fdopen(os.dup(1), "w")  # the result lines own stdout; what vLLM and Mooncake print goes to stderr
os.dup2(2, 1)
sys.stdout = sys.stderr
from p2pweights import WeightSender
from p2pweights.control import VllmEngine
from p2pweights.models.checkpoint import random_checkpoint, trainer_tensors
cfg, url, key = sys.argv[1:4]
sender = WeightSender(cfg, transport="mooncake", buffer_size=1 << 20)
sender.connect([VllmEngine(url, api_key=key)])
replicas = [p.replica for p in sender.prepared]
print(json.dumps({"event": "connected", "layout": replicas[0].engine.describe(),
                  "replayed": [r.replayed for r in replicas]}), file=out, flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    changed = tuple(cmd["changed"]) if cmd["changed"] else None
    try:
        with sender.update(version=cmd["version"], verify=True) as update:
            for name, tensor in random_checkpoint(trainer_tensors(cfg), cmd["seed"], changed=changed):
                update.push(name, tensor)  # BF16, as a trainer holds it: quantized and replayed on send
        r = update.report
        print(json.dumps({"ok": True, "bytes": r.bytes, "bytes_written": r.bytes_written,
                          "delta_reason": r.delta_reason, "verify_seconds": sender._update.verify_seconds,
                          "ranks": [{"delta": e.delta, "bytes": e.bytes, "written": e.bytes_written}
                                    for e in r.engines]}), file=out, flush=True)
    except Exception as e:
        print(json.dumps({"ok": False, "error": type(e).__name__, "message": str(e)}), file=out, flush=True)
sender.close()
'''


class Sender:
    """:data:`SENDER` in a process of its own, one update per call."""

    def __init__(self, engine: TpEngine):
        self.proc = subprocess.Popen([sys.executable, "-c", SENDER, engine.cfg, engine.url, engine.key],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info: dict = {}

    def connected(self) -> dict:
        return read_json_line(self.proc, STARTUP)

    def update(self, version: str, seed: int, changed=None) -> dict:
        self.proc.stdin.write(json.dumps({"version": version, "seed": seed, "changed": changed}) + "\n")
        self.proc.stdin.flush()
        return read_json_line(self.proc, 600)

    def close(self) -> None:
        end_child(self.proc)


@pytest.fixture(scope="module")
def cfg():
    return str(resolve_model(MODEL))


@pytest.fixture(scope="module")
def engine(cfg, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_hopper")
    with standin(cfg, root, "vllm-hopper", TpEngine, hopper=HOPPER) as running:
        yield running


@pytest.fixture(scope="module")
def sender(engine):
    running = Sender(engine)
    try:
        running.info = running.connected()  # the connect's layout and each rank's replayed modules
        yield running
    finally:
        running.close()


def reference(cfg, seed, changed=None, post_process=True):
    """Per rank, vLLM's model of a Hopper engine rank loaded from checkpoint ``seed`` (``changed``)
    and post-processed, by the replica's reference path: ``[model of rank 0, model of rank 1]``."""
    from p2pweights.replica.vllm_check import reference_model
    from p2pweights.replica.vllm_layout import VllmLayout

    layout = VllmLayout.parse(HOPPER)
    return [reference_model(cfg, layout, rank, seed=seed, changed=changed, post_process=post_process)
            for rank in range(layout.world_size)]


def checksums(models) -> dict[str, str]:
    """vLLM's ``/weight_checker`` digests of ``models`` (rank order), keyed ``tp<rank>:<name>`` as
    :meth:`TpEngine.checksums` keys the engine's (EP ranks are TP ranks of one DP rank)."""
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    return {f"tp{rank}:{name}": d for rank, model in enumerate(models)
            for name, d in compute_tensor_digests(model).items()}


def test_the_engine_holds_a_hopper_ranks_post_processed_fp8_moe_and_publishes_it(cfg, engine, sender):
    import torch
    from vllm.model_executor.layers.quantization.utils.flashinfer_utils import swap_w13_to_w31

    served = reference(cfg, ENGINE_SEED)
    assert engine.checksums() == checksums(served)  # both ranks: what the Hopper stand-in's load leaves
    # the two transforms ran on the engine's bytes: power-of-two (UE8M0) scales, w13 in w31 order
    scale = dict(served[0].named_parameters())[f"{LINEAR}.weight_scale_inv"].detach()
    assert torch.equal(torch.log2(scale), torch.log2(scale).round())
    w13 = f"{EXPERTS}.w13_weight"
    loaded = dict(reference(cfg, ENGINE_SEED, post_process=False)[1].named_parameters())[w13]
    held = dict(served[1].named_parameters())[w13]
    assert not torch.equal(loaded.view(torch.uint8), held.view(torch.uint8))
    assert torch.equal(swap_w13_to_w31(loaded).view(torch.uint8), held.view(torch.uint8))
    # vLLM's /server_info serves the Hopper engine's config; every rank publishes its own memory
    status, info = engine.call("GET", "/server_info", params={"config_format": "json"})
    assert status == 200 and info["vllm_config"]["weight_transfer_config"]["backend"] == "p2pweights"
    assert info["vllm_config"]["parallel_config"]["enable_expert_parallel"] is True
    peers = set()
    for rank, model in enumerate(served):
        status, pub = engine.call("GET", "/remote_instance_transfer_engine_info", params={"rank": rank})
        assert status == 200 and pub["rank"] == rank and pub["delta_area"], pub
        peer, table = pub["remote_instance_transfer_engine_info"]
        peers.add(peer)
        # what the loaders wrote, nothing post-processing derived (MLA's W_UV / W_UK_T: strided views of
        # the dequantized kv_b_proj, derived again by each finish; rank_memory.owned_parameters)
        assert set(table) == {n for n, _ in model.named_parameters()} - set(model._p2pw_added_by_post_processing)
        assert {"W_UV", "W_UK_T"} <= {n.rsplit(".", 1)[-1] for n in model._p2pw_added_by_post_processing}
    assert len(peers) == 2
    # the sender reads vLLM's default Hopper layout and replays both of its kernels' post-processing
    assert sender.info["layout"] == "vllm:tp=2,ep=2,dtype=bfloat16", sender.info
    for replayed in sender.info["replayed"]:
        assert replayed[LINEAR] == "deepgemm_e8m0" and replayed[EXPERTS] == "flashinfer_cutlass_w31", replayed


def test_full_then_one_percent_delta_updates_are_byte_exact_on_every_rank(cfg, engine, sender):
    full = sender.update("hopper-0", SEED)
    assert full["ok"], full
    previous = checksums(reference(cfg, SEED))
    assert engine.checksums() == previous
    assert full["bytes_written"] == full["bytes"] > 0 and not any(r["delta"] for r in full["ranks"]), full
    assert engine.call("GET", "/weight_info")[1]["weight_version"] == "hopper-0"
    for step in (1, 2):
        done = sender.update(f"hopper-{step}", SEED, changed=[FRACTION, step])
        assert done["ok"], done
        expected = checksums(reference(cfg, SEED, changed=(FRACTION, step)))
        held = engine.checksums()
        assert held == expected, sorted(n for n in held if held[n] != expected.get(n))
        assert expected != previous  # each step moved bytes the check sees
        previous = expected
        assert done["delta_reason"] == {} and all(r["delta"] for r in done["ranks"]), done
        # a changed element may move its block's (power-of-two) scale, and the block's bytes with it
        assert 0 < done["bytes_written"] < full["bytes_written"] // 4 and done["bytes"] == full["bytes"], done
        assert done["verify_seconds"] > 0
        print(f"step {step}: {done['bytes_written']} of {done['bytes']} bytes written "
              f"(full update: {full['bytes_written']})")
    assert engine.call("GET", "/weight_info")[1]["weight_version"] == "hopper-2"
    assert engine.call("GET", "/is_paused")[1]["is_paused"] is False
