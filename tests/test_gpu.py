"""The CUDA paths: pinned host slots, GPU slots, loaders from GPU tensors. Skipped without a GPU
(CI has none); run on the GPU machine with `bash benchmarks/gpu/run_on_device.sh` or pytest there."""
from __future__ import annotations

import pytest
import torch

from p2pweights import _native
from p2pweights.sender.buffers import TransferBuffers

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
    from p2pweights.models.checkpoint import random_checkpoint
    from p2pweights.replica import EngineLayout, model_replicas
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


@pytest.mark.parametrize("buffer_device,num_slots", [("cpu", 2), ("cpu", 1), ("cuda", 2)])
def test_updates_from_gpu_tensors_are_byte_exact(tmp_path, buffer_device, num_slots):
    # host slots fed from GPU tensors go through the GPU staging buffers with their D2H deferred by
    # one slot (StagedHostSlotFiller, sender/gpu_staging.py); small slots make many of them, and one slot
    # checks the no-deadlock path
    from p2pweights.control import SglangEngine
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
    from p2pweights.receiver.local import check_weights_equal, start_engines
    from p2pweights.sender import WeightSender
    from replica_configs import write_config

    cfg = write_config("qwen3", str(tmp_path), hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=2048)
    (engine,) = start_engines(cfg, "tp=2", count=1, transport="mooncake", name_prefix=f"gpu-{buffer_device}-")
    try:
        specs = checkpoint_tensors(cfg)
        with WeightSender(cfg, transport="mooncake", buffer_size=256 << 10, num_slots=num_slots,
                          buffer_device=buffer_device) as sender:
            sender.connect([SglangEngine(engine.url, name=engine.name)])
            for step in (1, 2):
                with sender.update(f"v{step}") as u:
                    for name, t in random_checkpoint(specs, step):
                        u.push(name, t.cuda())
                assert u.report.slots > 4
                result = check_weights_equal(engine.url, hf_seed=step)
                assert result["success"], result["message"]
    finally:
        engine.close()
