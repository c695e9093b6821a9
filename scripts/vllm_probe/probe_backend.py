"""A stand-in p2pweights backend: registered through WeightTransferEngineFactory, created the way
gpu_worker.load_model creates it, driven in the worker's order (init -> start -> update -> finish)
against a stand-in-built model on CPU. One-sided writes are simulated by copying bytes into params."""
import sys, dataclasses
import torch
sys.path.insert(0, "/tmp/vllm_probe")
import hopper_platform; hopper_platform.install()
from vllm.engine.arg_utils import EngineArgs
from vllm.config import set_current_vllm_config
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests
from vllm.utils.torch_utils import set_default_torch_dtype
from standin import engine_rank
from hf_ckpt import hf_checkpoint

@dataclasses.dataclass
class InitInfo(WeightTransferInitInfo):
    session: str = ""

@dataclasses.dataclass
class UpdateInfo(WeightTransferUpdateInfo):
    epoch: int = 0

class P2PProbeEngine(WeightTransferEngine[InitInfo, UpdateInfo]):
    init_info_cls, update_info_cls = InitInfo, UpdateInfo
    supports_draft_weight_update = False
    calls = []
    def init_transfer_engine(self, init_info):
        self.calls.append(("init", init_info))
        # here: register param memory with NIXL/Mooncake; publish via side channel
        self.regions = {n: (p.data_ptr(), p.numel() * p.element_size()) for n, p in self.model.named_parameters()}
    def start_weight_update(self):
        self.calls.append(("start",))
    def receive_weights(self, update_info):
        self.calls.append(("receive", update_info))  # one-sided writes: nothing to do
    def finish_weight_update(self):
        self.calls.append(("finish",))
        process_weights_after_loading(self.model, self.model_config, self.device)
    def shutdown(self):
        self.calls.append(("shutdown",))

cfg = sys.argv[1]
WeightTransferEngineFactory.register_engine("p2pweights_probe", P2PProbeEngine)
vc = EngineArgs(model=cfg, skip_tokenizer_init=True, dtype="bfloat16", load_format="dummy", enforce_eager=True,
                max_model_len=256, weight_transfer_config={"backend": "p2pweights_probe"}).create_engine_config()
print("weight_transfer_config:", vc.weight_transfer_config)
A, B = hf_checkpoint(cfg, 0), hf_checkpoint(cfg, 1)
def build(ck):
    vc.compilation_config.static_forward_context.clear()
    with engine_rank(0, tp=1, is_moe=vc.model_config.is_moe), set_current_vllm_config(vc):
        with set_default_torch_dtype(torch.bfloat16), torch.device("cpu"):
            m = initialize_model(vllm_config=vc)
        m.load_weights(iter(ck.items()))
        raw = {n: p.detach().clone() for n, p in m.named_parameters()}
        process_weights_after_loading(m, vc.model_config, torch.device("cpu"))
    return m, raw
live, _ = build(A)
ref, rawB = build(B)
with engine_rank(0, tp=1, is_moe=vc.model_config.is_moe), set_current_vllm_config(vc):
    eng = WeightTransferEngineFactory.create_engine(vc.weight_transfer_config, vc, torch.device("cpu"), live)
    eng.init_transfer_engine(eng.parse_init_info({"session": "s1"}))
    eng.start_weight_update()
    params = dict(live.named_parameters())
    for n, t in rawB.items():      # the sender's one-sided writes
        params[n].data.copy_(t)
    eng.receive_weights(eng.parse_update_info({"epoch": 1}))
    eng.finish_weight_update()
d1, d2 = compute_tensor_digests(live), compute_tensor_digests(ref)
print("calls:", [c[0] for c in P2PProbeEngine.calls])
print("weight_checker digests equal to a fresh load of B:", d1 == d2, f"({len(d1)} tensors)")
