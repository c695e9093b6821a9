"""Is process_weights_after_loading idempotent on an already processed model (the p2p finish step)?
Run: load ckpt A, post-process; then overwrite the checkpoint-format params in place with ckpt B's
bytes (as one-sided writes would), re-run post-processing, compare with a fresh load of B."""
import os, sys, json
import torch
sys.path.insert(0, "/tmp/vllm_probe")
import hopper_platform; hopper_platform.install()
from vllm.engine.arg_utils import EngineArgs
from vllm.config import set_current_vllm_config
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype
from standin import engine_rank
from hf_ckpt import hf_checkpoint
cfg = sys.argv[1]
vc = EngineArgs(model=cfg, skip_tokenizer_init=True, dtype="bfloat16", load_format="dummy", enforce_eager=True, max_model_len=256).create_engine_config()
A, B = hf_checkpoint(cfg, seed=0), hf_checkpoint(cfg, seed=1)
def build_load(ck):
    vc.compilation_config.static_forward_context.clear()
    with engine_rank(0, tp=1, is_moe=vc.model_config.is_moe), set_current_vllm_config(vc):
        with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
            m = initialize_model(vllm_config=vc)
        m.load_weights(iter(ck.items()))
        raw = {n: p.detach().clone() for n, p in m.named_parameters()}
        process_weights_after_loading(m, vc.model_config, torch.device("cpu"))
    return m, raw
mA, rawA = build_load(A)
mB, rawB = build_load(B)
# one-sided writes: B's loaded (pre-post-processing) bytes into A's live params
live = dict(mA.named_parameters())
for n, t in rawB.items():
    live[n].data.copy_(t)
with engine_rank(0, tp=1, is_moe=vc.model_config.is_moe), set_current_vllm_config(vc):
    process_weights_after_loading(mA, vc.model_config, torch.device("cpu"))
after = dict(mA.named_parameters()); ref = dict(mB.named_parameters())
bad = [n for n in ref if not torch.equal(after[n].detach().contiguous().view(torch.uint8), ref[n].detach().contiguous().view(torch.uint8))]
same_storage = [n for n in live if after[n].data_ptr() != live[n].data_ptr()]
print(f"re-post-process after in-place writes: {len(ref)} params, differ from fresh load: {bad}; params whose storage moved: {same_storage}")
