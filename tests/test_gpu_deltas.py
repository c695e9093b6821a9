"""Delta updates into an engine whose weights, and so its delta area, are on a GPU (a VRAM receiver,
``P2PW_RECEIVER_DEVICE=cuda:0``), from senders with GPU slots and with host slots. A GPU area takes
index records only (deltas/area.py): a host-slot sender must write those to it, not its codec
records. Skipped without a GPU (CI has none); run on the GPU machine (benchmarks/gpu/run_on_device.sh
with DEVICE_TESTS)."""
from __future__ import annotations

import pytest
import torch

from p2pweights import _native

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or _native.cuda_runtime_info()["device_count"] == 0,
                       reason="needs a CUDA device and runtime (the CI machines have none)"),
]

CHANGED = (0.01, 1)  # version 1 of seed 3's changed family: about 1% of the elements differ


@pytest.mark.parametrize("buffer_device, pushed", [("cpu", "cpu"), ("cpu", "cuda"), ("cuda", "cuda")],
                         ids=["host-slots", "host-slots-from-gpu-tensors", "gpu-slots"])
def test_a_vram_engine_takes_deltas_from_host_slots_and_from_gpu_slots(tmp_path, buffer_device, pushed):
    """Host slots fed from GPU tensors (staged: sender/fillers.py) are compared once each slot's copies
    to the host landed, and take deltas as the others do."""
    from p2pweights.control import SglangEngine
    from p2pweights.models.checkpoint import checkpoint_tensors, random_checkpoint
    from p2pweights.receiver import start_engine
    from p2pweights.receiver.local import check_weights_equal
    from p2pweights.sender import WeightSender
    from replica_configs import write_config

    cfg = write_config("qwen3", str(tmp_path), hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=2048)
    name = f"vram-{buffer_device}-slots-{pushed}"
    engine = start_engine(cfg, "tp=1", transport="nixl", name=name,
                          env={"P2PW_RECEIVER_DEVICE": "cuda:0", "P2PW_DELTA_AREA": str(16 << 20)},  # a GPU area is sized
                          startup_timeout=600)
    try:
        specs = checkpoint_tensors(cfg)
        with WeightSender(cfg, transport="nixl", buffer_device=buffer_device) as sender:
            sender.connect([SglangEngine(engine.url, name=name)])
            reports = []
            for step, changed in ((1, None), (2, CHANGED)):
                with sender.update(f"v{step}") as u:
                    for hf, t in random_checkpoint(specs, 3, changed=changed):
                        u.push(hf, t.cuda() if pushed == "cuda" else t)
                reports.append(u.report.engines[0])
                result = check_weights_equal(engine.url, hf_seed=3, changed_fraction=changed and changed[0],
                                             changed_steps=changed and changed[1])
                assert result["success"], result["message"]
        first, second = reports
        assert not first.delta and second.delta, (first.delta_reason, second.delta_reason)
        assert 0 < second.bytes_written < second.bytes // 4, (second.bytes_written, second.bytes)
    finally:
        engine.close()


def test_a_vllm_workers_gpu_weights_keep_their_area_on_the_gpu_and_take_index_records():
    """The vLLM backend's rank memory (vllm_backend/rank_memory.py; no vLLM needed) over parameters
    on the GPU, each its own allocation: the area is on their device, published, and an index record
    written into it is applied through each parameter's own storage, exactly; a record whose rows
    point at memory no parameter holds is refused whole."""
    from p2pweights.errors import InvalidWrite, OutOfRegion
    from p2pweights.vllm_backend.rank_memory import RankMemory
    from test_delta_index_records import Rank, _changed, _find

    gen = torch.Generator().manual_seed(5)
    model = torch.nn.Module()
    for k, n in enumerate((4096, 333, 1 << 16)):
        model.register_parameter(f"w{k}", torch.nn.Parameter(torch.randn(n, generator=gen).bfloat16().cuda(),
                                                             requires_grad=False))
    params = [p for _, p in model.named_parameters()]
    unsized = RankMemory(model, "nixl", 0, "vllm-gpu-test", deltas=True)  # a GPU area only where sized
    assert unsized.area is None and unsized.publication().get("delta_area") is None
    unsized.close()
    memory = RankMemory(model, "nixl", 0, "vllm-gpu-test", deltas=True, area=16 << 20)
    try:
        assert memory.area is not None and memory.area.device == "cuda:0"
        assert memory.publication()["delta_area"] == [memory.area.address, memory.area.nbytes]
        old = [p.detach().clone() for p in params]
        new = [_changed(p.cpu(), 0.03, k).cuda() for k, p in enumerate(old)]

        def record(rows_at) -> dict:
            found, _ = _find(old, new, 2)
            rank = Rank(old, "cuda")
            rank.area = memory.area  # the sender's one-sided write, made here directly
            table, pos = [], 0
            for p in params:
                table.append((pos, p.numel(), rows_at(p)))
                pos += p.numel()
            rank.write(found, table)
            return {"0": rank.manifest().to_dict()}

        # rows pointing into the area itself: registered memory, but no parameter's
        with pytest.raises((InvalidWrite, OutOfRegion)):
            memory.apply_deltas(record(lambda p: memory.area.address + (1 << 20)))
        assert all(torch.equal(p.detach(), o) for p, o in zip(params, old))  # nothing applied
        out = memory.apply_deltas(record(lambda p: p.data_ptr()))
        assert out["records"] == 1 and out["index_path"] in ("kernels", "torch"), out
        for k, (p, want) in enumerate(zip(params, new)):
            assert torch.equal(p.detach(), want), f"parameter {k}"
    finally:
        memory.close()
