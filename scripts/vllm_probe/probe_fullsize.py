"""Real-shape configs on meta, one engine rank (timing + bytes per rank)."""
import sys, time
import torch
sys.path.insert(0, "/tmp/vllm_probe")
import hopper_platform; hopper_platform.install()
from vllm.engine.arg_utils import EngineArgs
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.utils import initialize_model
from vllm.utils.torch_utils import set_default_torch_dtype
from standin import engine_rank
cfg, tp, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
vc = EngineArgs(model=cfg, skip_tokenizer_init=True, dtype="bfloat16", load_format="dummy", enforce_eager=True,
                max_model_len=4096, tensor_parallel_size=tp, enable_expert_parallel=tp > 1).create_engine_config()
t = time.time()
with engine_rank(rank, tp=tp, is_moe=vc.model_config.is_moe), set_current_vllm_config(vc):
    with set_default_torch_dtype(torch.bfloat16), torch.device("meta"):
        m = initialize_model(vllm_config=vc)
ps = list(m.named_parameters())
print(f"{cfg} TP{tp} rank {rank}: {len(ps)} params, {sum(p.numel()*p.element_size() for _, p in ps)/1e9:.3f} GB, built in {time.time()-t:.1f}s")
