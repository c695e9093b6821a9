"""The CUDA paths: pinned host slots, GPU slots, loaders from GPU tensors. Skipped without a GPU
(CI has none); run on the GPU machine with `bash benchmarks/gpu/run_on_device.sh` or pytest there."""
from __future__ import annotations

import pytest
import torch

from p2pweights import _native
from p2pweights.buffers import TransferBuffers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or _native.cuda_runtime_info()["device_count"] == 0,
                       reason="needs a CUDA device and runtime (the CI machines have none)"),
]


def test_host_slots_are_pinned_by_cuda_host_registration():
    with TransferBuffers(2 << 20, 2, pin="auto") as b:
        assert b.pin_mode == "cuda_host_register"
        host = b.slot_tensor(0)
        dev = torch.arange(host.numel(), device="cuda").to(torch.uint8)
        host.copy_(dev, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(host, dev.cpu())


def test_gpu_slots_live_on_the_device_and_are_distinct():
    with TransferBuffers(2 << 20, 2, device="cuda") as b:
        a, c = b.slot_tensor(0), b.slot_tensor(1)
        assert a.is_cuda and b.location.startswith("cuda") and b.slot_address(0) == a.data_ptr()
        a.fill_(1)
        c.fill_(2)
        assert int(a.sum()) == a.numel() and int(c.sum()) == 2 * c.numel()


def test_loaders_from_gpu_tensors_into_gpu_slots_match_host_slots(tmp_path):
    from p2pweights.replica import EngineLayout, model_replicas
    from p2pweights.replica.hf_checkpoint import random_checkpoint
    from replica_configs import write_config

    cfg = write_config("qwen3", str(tmp_path))
    rep = model_replicas().get(cfg, EngineLayout.parse("tp=2"), 1)
    tensors = dict(random_checkpoint(rep.hf_specs, 3))
    placed, off = [], 0
    for g in rep.groups:
        placed.append((g, off))
        off = -(-(off + g.nbytes) // 256) * 256
    need = {n for g, _ in placed for n in g.hf_names}
    host = torch.zeros(off, dtype=torch.uint8)
    gpu = torch.zeros(off, dtype=torch.uint8, device="cuda")
    rep.load_groups(placed, {n: tensors[n] for n in need}, host)
    rep.load_groups(placed, {n: tensors[n].cuda() for n in need}, gpu)
    torch.cuda.synchronize()
    assert torch.equal(gpu.cpu(), host)
