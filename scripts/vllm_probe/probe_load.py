"""Probe: build one TP rank of a vLLM model on CPU, load HF-named random weights, post-process, compare bytes.

usage: probe_load.py CFG_DIR [tp_size tp_rank]   (tp>1 run under torchrun-like env: see probe_tp2.sh)
"""
import os, sys, time, json
import torch
sys.path.insert(0, "/tmp/vllm_probe")
if os.environ.get("PROBE_PLATFORM", "cpu") == "cpu":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
else:
    import hopper_platform; print("platform:", type(hopper_platform.install()).__name__, flush=True)

cfg_dir = sys.argv[1]
tp = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
t0 = time.time()
from vllm.engine.arg_utils import EngineArgs
from vllm.config import set_current_vllm_config
from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype
extra = json.loads(os.environ.get("PROBE_ARGS", "{}"))
args = EngineArgs(model=cfg_dir, skip_tokenizer_init=True, dtype="bfloat16", load_format="dummy",
                  tensor_parallel_size=tp, enforce_eager=True, max_model_len=256,
                  distributed_executor_backend="external_launcher" if tp > 1 else None, **extra)
vllm_config = args.create_engine_config()
print(f"[{rank}] config ok {time.time()-t0:.1f}s quant={vllm_config.quant_config}", flush=True)
import vllm.distributed.parallel_state as ps
_orig_group = ps.init_model_parallel_group
def _no_device_comm(*a, **k):  # a real CUDA communicator needs a GPU; groups stay gloo-only
    k["use_device_communicator"] = False
    return _orig_group(*a, **k)
ps.init_model_parallel_group = _no_device_comm
with set_current_vllm_config(vllm_config):
    init_distributed_environment(world_size=tp, rank=rank, local_rank=rank,
                                 distributed_init_method=f"tcp://127.0.0.1:{os.environ.get('MASTER_PORT','29555')}",
                                 backend="gloo")
    initialize_model_parallel(tensor_model_parallel_size=tp)
with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("meta"):
    meta_model = initialize_model(vllm_config=vllm_config)
meta_shapes = {n: (tuple(p.shape), p.dtype) for n, p in meta_model.named_parameters()}
print(f"[{rank}] meta build ok: {len(meta_shapes)} params", flush=True)
# Attention layers register by name in the config's static_forward_context: a second build in the
# same VllmConfig raises "Duplicate layer name" unless it is cleared.
vllm_config.compilation_config.static_forward_context.clear()
with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("cpu"):
    model = initialize_model(vllm_config=vllm_config)
cpu_shapes = {n: (tuple(p.shape), p.dtype) for n, p in model.named_parameters()}
assert cpu_shapes == meta_shapes, "meta and cpu layouts differ"

# HF-named random checkpoint from the reference weights file, if any, else from transformers.
ckpt = torch.load(os.path.join(cfg_dir, "hf_state.pt")) if os.path.exists(os.path.join(cfg_dir, "hf_state.pt")) else None
if ckpt is None:
    from hf_ckpt import hf_checkpoint
    ckpt = hf_checkpoint(cfg_dir)
with set_current_vllm_config(vllm_config):
    loaded = model.load_weights(iter(ckpt.items()))
print(f"[{rank}] load_weights ok: {len(loaded) if loaded is not None else None} loaded", flush=True)
before = {n: p.detach().clone() for n, p in model.named_parameters()}
with set_current_vllm_config(vllm_config):
    process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
after = dict(model.named_parameters())
changed = [n for n in before if n not in after or after[n].shape != before[n].shape or after[n].dtype != before[n].dtype
           or not torch.equal(after[n].view(torch.uint8) if after[n].dtype != torch.bool else after[n], before[n].view(torch.uint8))]
added = [n for n in after if n not in before]
print(f"[{rank}] process_weights_after_loading ok: changed={changed[:10]} (n={len(changed)}) added={added[:10]}", flush=True)
# Byte checks against the HF checkpoint for the fused Qwen3 projections (rank's shard).
def shard(t, dim):
    n = t.shape[dim] // tp
    return t.narrow(dim, rank * n, n)
checks = 0
for n, p in after.items():
    if n.endswith("qkv_proj.weight"):
        pre = n[:-len("qkv_proj.weight")]
        ref = torch.cat([shard(ckpt[pre + x + "_proj.weight"], 0) for x in "qkv"])
    elif n.endswith("mlp.gate_up_proj.weight"):
        pre = n[:-len("gate_up_proj.weight")]
        ref = torch.cat([shard(ckpt[pre + "gate_proj.weight"], 0), shard(ckpt[pre + "up_proj.weight"], 0)])
    elif n.endswith("o_proj.weight") or n.endswith("mlp.down_proj.weight"):
        ref = shard(ckpt[n], 1)
    elif "experts.routed_experts.w13_weight" in n or "experts.routed_experts.w2_weight" in n:
        if vllm_config.parallel_config.enable_expert_parallel:
            continue  # EP placement: compared against a real gloo run by probe_standin.py
        pre = n.split("experts.routed_experts.")[0] + "experts."
        if ckpt[f"{pre}0.down_proj.weight"].dtype != p.dtype:
            continue
        ne = p.shape[0]
        if n.endswith("w13_weight"):
            ref = torch.stack([torch.cat([shard(ckpt[f"{pre}{e}.gate_proj.weight"], 0), shard(ckpt[f"{pre}{e}.up_proj.weight"], 0)]) for e in range(ne)])
        else:
            ref = torch.stack([shard(ckpt[f"{pre}{e}.down_proj.weight"], 1) for e in range(ne)])
    elif n in ckpt and ckpt[n].shape == p.shape:
        ref = ckpt[n]
    else:
        continue
    assert torch.equal(p.detach(), ref), f"bytes differ: {n}"
    checks += 1
print(f"[{rank}] byte checks passed: {checks} of {len(after)} params; total {time.time()-t0:.1f}s", flush=True)
out = os.environ.get("PROBE_SAVE")
if out:
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{out}_r{rank}.pt")
    torch.save(ckpt, f"{out}_ckpt.pt")
