"""Build every TP rank of a layout in ONE process with stand-in groups; load + post-process on CPU;
compare against the per-rank results a real gloo run saved (probe_tp.sh with PROBE_SAVE)."""
import os, sys, json, time
import torch
sys.path.insert(0, "/tmp/vllm_probe")
if os.environ.get("PROBE_PLATFORM", "cpu") == "cpu":
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
else:
    import hopper_platform; print("platform:", type(hopper_platform.install()).__name__, flush=True)
sys.path.insert(0, os.path.dirname(__file__))
cfg_dir, tp, saved = sys.argv[1], int(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None
extra = json.loads(os.environ.get("PROBE_ARGS", "{}"))
t0 = time.time()
from vllm.engine.arg_utils import EngineArgs
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype
from standin import engine_rank
args = EngineArgs(model=cfg_dir, skip_tokenizer_init=True, dtype="bfloat16", load_format="dummy",
                  tensor_parallel_size=tp, enforce_eager=True, max_model_len=256,
                  **extra)
vllm_config = args.create_engine_config()
pc = vllm_config.parallel_config
print(f"config ok {time.time()-t0:.1f}s tp={pc.tensor_parallel_size} dp={pc.data_parallel_size} ep={pc.enable_expert_parallel}", flush=True)
ckpt = torch.load(f"{saved}_ckpt.pt") if saved else None
for rank in range(tp * pc.data_parallel_size):
    vllm_config.compilation_config.static_forward_context.clear()
    pc.data_parallel_rank = rank // tp  # each DP rank is its own engine core in vLLM
    with engine_rank(rank, tp=tp, dp=pc.data_parallel_size, is_moe=vllm_config.model_config.is_moe), \
         set_current_vllm_config(vllm_config):
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("meta"):
            model = initialize_model(vllm_config=vllm_config)
        print(f"[{rank}] meta ok: " + ", ".join(f"{n}{tuple(p.shape)}" for n, p in list(model.named_parameters())[:4]), flush=True)
        ex = [m for m in model.modules() if hasattr(m, "expert_map")]
        if ex:
            m = ex[0]
            print(f"[{rank}]   moe: local_num_experts={getattr(m, 'local_num_experts', None)} ep_rank={getattr(m, 'ep_rank', None)} "
                  f"ep_size={getattr(m, 'ep_size', None)} tp_size={getattr(m, 'tp_size', None)} expert_map={getattr(m, 'expert_map', None)}", flush=True)
        if ckpt is None:
            continue
        vllm_config.compilation_config.static_forward_context.clear()
        with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vllm_config)
        model.load_weights(iter(ckpt.items()))
        process_weights_after_loading(model, vllm_config.model_config, torch.device("cpu"))
    ref = torch.load(f"{saved}_r{rank}.pt")
    mine = dict(model.named_parameters())
    assert mine.keys() == ref.keys(), (set(mine) ^ set(ref))
    bad = [n for n in ref if mine[n].shape != ref[n].shape or mine[n].dtype != ref[n].dtype
           or not torch.equal(mine[n].detach().contiguous().view(-1).view(torch.uint8), ref[n].contiguous().view(-1).view(torch.uint8))]
    print(f"[{rank}] vs real gloo rank: {len(ref)} params, {len(bad)} differ {bad[:5]}", flush=True)
print(f"done {time.time()-t0:.1f}s")
