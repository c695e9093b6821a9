"""Probe: build a vLLM model for one TP rank on meta/CPU, run load_weights + process_weights_after_loading."""
import os, sys, time, traceback
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import torch

cfg_dir = sys.argv[1] if len(sys.argv) > 1 else "/tmp/vllm_probe/cfg/qwen3_tiny"
device = sys.argv[2] if len(sys.argv) > 2 else "meta"
t0 = time.time()
from vllm.engine.arg_utils import EngineArgs
from vllm.config import set_current_vllm_config
from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype
print("platform:", __import__("vllm.platforms", fromlist=["x"]).current_platform.__class__.__name__)

args = EngineArgs(model=cfg_dir, skip_tokenizer_init=True, dtype="bfloat16", load_format="dummy",
                  tensor_parallel_size=1, enforce_eager=True, max_model_len=256)
vllm_config = args.create_engine_config()
print("config ok", time.time() - t0)
with set_current_vllm_config(vllm_config):
    init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                 distributed_init_method="tcp://127.0.0.1:29555", backend="gloo")
    initialize_model_parallel(tensor_model_parallel_size=1)
print("dist ok")
with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device(device):
    model = initialize_model(vllm_config=vllm_config)
print("model built on", device, type(model).__name__)
for n, p in list(model.named_parameters())[:50]:
    print(f"  {n} {tuple(p.shape)} {p.dtype} {p.device} {type(p).__name__}")
print("n params", len(list(model.named_parameters())))
