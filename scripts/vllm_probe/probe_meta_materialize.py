"""Build on meta, materialize with p2pweights' replica helpers (class + __dict__ kept), run vLLM's
loaders and post-processing on CPU, compare bytes with a model built directly on CPU."""
import sys
import torch
sys.path.insert(0, "/tmp/vllm_probe")
import hopper_platform; hopper_platform.install()
from vllm.engine.arg_utils import EngineArgs
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype
from p2pweights.replica.sglang_env import materialize  # torch-only helper
from standin import engine_rank
from hf_ckpt import hf_checkpoint
cfg, tp, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
vc = EngineArgs(model=cfg, skip_tokenizer_init=True, dtype="bfloat16", load_format="dummy", enforce_eager=True,
                max_model_len=256, tensor_parallel_size=tp, enable_expert_parallel=tp > 1 and "moe" in cfg or (tp > 1 and "dsv3" in cfg)).create_engine_config()
ck = hf_checkpoint(cfg)
out = {}
for dev in ("meta", "cpu"):
    vc.compilation_config.static_forward_context.clear()
    with engine_rank(rank, tp=tp, is_moe=vc.model_config.is_moe), set_current_vllm_config(vc):
        with set_default_torch_dtype(torch.bfloat16), torch.device(dev):
            m = initialize_model(vllm_config=vc)
        if dev == "meta":
            materialize(m, "cpu")
        m.load_weights(iter(ck.items()))
        process_weights_after_loading(m, vc.model_config, torch.device("cpu"))
    out[dev] = {n: p.detach().contiguous() for n, p in m.named_parameters()}
bad = [n for n in out["cpu"] if n not in out["meta"] or not torch.equal(out["cpu"][n].view(torch.uint8), out["meta"][n].view(torch.uint8))]
print(f"meta->materialize->load->post vs cpu-built: {len(out['cpu'])} params, differ: {bad}")
