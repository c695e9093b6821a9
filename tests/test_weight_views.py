"""What a delta area's records write through where an engine placed the weights (deltas/weight_views.py):
host ranges merged; GPU weights one range per parameter, through its own storage. The per-parameter
path is the GPU one (the sglang plugin's and the vLLM backend's GPU areas); its logic is the same on
any device, so it runs here on CPU tensors. And a sender writes index records, not runs, to a rank
whose area is on a GPU (sender/delta_writes.py ``gpu_areas``)."""
from __future__ import annotations

import types

import pytest
import torch

from p2pweights.deltas.weight_views import device_views, host_views, parameter_bytes
from p2pweights.errors import InvalidWrite, OutOfRegion
from test_delta_index_records import Rank, _changed, _find


def _params() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(5)
    return [torch.nn.Parameter(torch.randn(n, generator=gen).bfloat16(), requires_grad=False)
            for n in (4096, 333, 1 << 14)]


def _record(params, old, new, rows_at) -> Rank:
    """One index record of old -> new, written into a fresh area, its rows at ``rows_at(param)``."""
    found, _ = _find(old, new, 2)
    rank = Rank(old, "cpu")  # its area and the sender's writing of a record into it
    table, pos = [], 0
    for p in params:
        table.append((pos, p.numel(), rows_at(p)))
        pos += p.numel()
    rank.write(found, table)
    return rank


def test_index_records_apply_through_each_parameters_own_storage_and_nowhere_else():
    params = _params()
    regions, tensors = device_views([(f"w{k}", p) for k, p in enumerate(params)])
    assert regions == [(p.data_ptr(), p.numel() * p.element_size()) for p in params]
    assert all(t.data_ptr() == p.data_ptr() and t.dtype == torch.uint8 for t, p in zip(tensors, params))
    old = [p.detach().clone() for p in params]
    new = [_changed(o, 0.03, k) for k, o in enumerate(old)]
    # rows at memory no parameter holds: refused whole, nothing applied
    elsewhere = torch.zeros(1 << 16, dtype=torch.uint8)
    stray = _record(params, old, new, lambda p: elsewhere.data_ptr())
    with pytest.raises((InvalidWrite, OutOfRegion)):
        stray.area.apply(stray.manifest(), regions, tensors)
    assert int(elsewhere.sum()) == 0
    assert all(torch.equal(p.detach(), o) for p, o in zip(params, old))
    rank = _record(params, old, new, lambda p: p.data_ptr())
    assert rank.area.apply(rank.manifest(), regions, tensors)["records"] == 1
    for k, (p, want) in enumerate(zip(params, new)):
        assert torch.equal(p.detach(), want), f"parameter {k}"


def test_host_ranges_merge_where_they_touch_and_a_view_spans_only_its_own_bytes():
    buf = torch.zeros(64, dtype=torch.uint8)
    a = buf.data_ptr()
    regions, tensors = host_views([(a, 16), (a + 16, 16), (a + 48, 8)])
    assert regions == [(a, 32), (a + 48, 8)] and [t.numel() for t in tensors] == [32, 8]
    tensors[1][:] = 7
    assert int(buf[48:56].sum()) == 56 and int(buf[:48].sum()) == 0
    p = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)
    tail = p[1:]  # a parameter that starts inside its storage
    view = parameter_bytes(tail)
    assert view.data_ptr() == tail.data_ptr() and view.numel() == tail.numel() * 2
    view[:2] = 0
    assert float(p[1, 0]) == 0.0 and float(p[0, 3]) == 3.0


def test_a_sender_writes_index_records_to_a_rank_whose_area_is_on_a_gpu():
    from p2pweights.sender.delta_targets import gpu_areas

    def rank(arch: str, area=(4096, 1 << 20)):
        return types.SimpleNamespace(publication=types.SimpleNamespace(device_arch=arch, delta_area=area))

    assert not gpu_areas(types.SimpleNamespace(targets=[rank("cpu"), rank("")]))  # host areas: runs
    assert gpu_areas(types.SimpleNamespace(targets=[rank("cpu"), rank("sm90")]))
    assert not gpu_areas(types.SimpleNamespace(targets=[rank("sm90", area=None)]))  # no area: nothing to write


def test_an_engine_hosts_gpu_rank_opens_an_area_only_where_it_was_sized(monkeypatch, caplog):
    """A GPU area takes memory the engine would give its KV cache: the vLLM backend (and the sglang
    plugin) open one only where init_info.area_bytes or P2PW_DELTA_AREA sizes it."""
    from p2pweights.vllm_backend.rank_memory import open_area

    monkeypatch.delenv("P2PW_DELTA_AREA", raising=False)
    with caplog.at_level("INFO"):
        assert open_area(1 << 30, None, 3, "engine-x", "cuda:0") is None  # nothing allocated on the GPU
    assert "P2PW_DELTA_AREA" in caplog.text and "rank 3" in caplog.text
    area = open_area(1 << 30, None, 0, "engine-x", "cpu")  # host memory: an eighth of the weights
    try:
        assert area is not None and area.nbytes == (1 << 30) // 8
    finally:
        area.close()
