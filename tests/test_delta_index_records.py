"""Index records (deltas/index_records.py), the GPU slots' delta encoding, through an engine rank's
delta area (deltas/area.py): exact round trips at several densities and units, and each way a
record can be wrong refused whole, with the weights untouched. On the CPU here; the CUDA cases run
where a GPU is (the same code, on the device)."""
from __future__ import annotations

import hashlib

import pytest
import torch

from p2pweights import _native
from p2pweights.deltas import index_records as ir
from p2pweights.deltas.area import PREFIX, DeltaArea, Manifest
from p2pweights.errors import InvalidWrite

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class Rank:
    """An engine rank's weights (one region) and its area; params placed at 256-byte boundaries."""

    def __init__(self, params: list[torch.Tensor], device: str):
        self.offsets, at = [], 0
        for p in params:
            self.offsets.append(at)
            at += -(-p.numel() * p.element_size() // 256) * 256
        self.weights = torch.zeros(at, dtype=torch.uint8, device=device)
        for p, o in zip(params, self.offsets):
            self.weights[o:o + p.numel() * p.element_size()] = p.reshape(-1).view(torch.uint8)
        self.area = DeltaArea(1 << 20, device=device)
        self.cursor, self.records, self.hash, self.checks, self.starts = 0, 0, hashlib.sha256(), [], []

    @property
    def regions(self):
        return [(self.weights.data_ptr(), self.weights.numel())]

    def param(self, k: int, like: torch.Tensor) -> torch.Tensor:
        n = like.numel() * like.element_size()
        return self.weights[self.offsets[k]:self.offsets[k] + n].view(like.dtype).view(like.shape)

    def write(self, found: ir.Found, table: list, *, payload_edit=None, head_edit=None) -> None:
        """What a sender writes: prefix + header + table, then the payload (its checksum on the device)."""
        payload = torch.zeros(ir.payload_bytes(found.count, found.unit), dtype=torch.uint8, device=self.weights.device)
        check = ir.write_payload(found, payload)
        if payload_edit is not None:
            payload_edit(payload)
            check = ir.checksum(payload)
        head = PREFIX.pack(0, ir.record_bytes(len(table), found.count, found.unit)) + ir.header_and_table(found, table)
        if head_edit is not None:
            head = head_edit(head)
        self.hash.update(head)
        self.checks.append(check)
        self.starts.append(self.cursor)  # the record's offset in the area
        raw = torch.frombuffer(bytearray(head), dtype=torch.uint8).to(self.weights.device)
        at = self.cursor
        target = self.area.tensor if self.area.device != "cpu" else torch.from_numpy(self.area.array)
        target[at:at + len(head)] = raw
        target[at + len(head):at + len(head) + payload.numel()] = payload
        self.cursor += len(head) + payload.numel()
        self.records += 1

    def manifest(self, offsets: bool = True) -> Manifest:
        """The owner's word: with each record's offset (as senders send it), or without (the rank walks)."""
        digest = self.hash.copy()
        digest.update(ir.checksum_words(self.checks))
        return Manifest(self.cursor, self.records, digest.hexdigest(), tuple(self.starts) if offsets else None)

    def apply(self, offsets: bool = True, manifest: Manifest | None = None) -> dict:
        return self.area.apply(manifest or self.manifest(offsets), self.regions, [self.weights])


def _laid_out(params: list[torch.Tensor], gap: int) -> tuple[torch.Tensor, list[int]]:
    """The parameters' bytes one after another, each on a 256-byte boundary after ``gap`` bytes."""
    offsets, at = [], 0
    for p in params:
        at += gap
        offsets.append(at)
        at += -(-p.numel() * p.element_size() // 256) * 256
    out = torch.full((at,), 0xAB, dtype=torch.uint8, device=params[0].device)
    for p, o in zip(params, offsets):
        out[o:o + p.numel() * p.element_size()] = p.reshape(-1).view(torch.uint8)
    return out, offsets


def _find(old: list[torch.Tensor], new: list[torch.Tensor], unit: int):
    """find_changes as a sender runs it: the new bytes in a slot, the old ones in the rank's base
    (other offsets than the slot's). Returns what it found and the base's parameters after it."""
    slot, so = _laid_out(new, 512)
    base, bo = _laid_out(old, 256)
    found = ir.find_changes(slot, base, [(s, b, p.numel() * p.element_size()) for s, b, p in zip(so, bo, new)], unit)
    return found, [base[b:b + p.numel() * p.element_size()] for b, p in zip(bo, new)]


def _changed(t: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    out = t.clone()
    flat = out.view(-1)
    k = int(flat.numel() * fraction)
    if k:
        idx = torch.randperm(flat.numel(), generator=gen)[:k]
        flat[idx] = (flat[idx].float() + 1).to(t.dtype)
    return out


def _table(rank: Rank, params: list[torch.Tensor], unit: int) -> list:
    rows, pos = [], 0
    for k, p in enumerate(params):
        n = p.numel() * p.element_size() // unit
        rows.append((pos, n, rank.weights.data_ptr() + rank.offsets[k]))
        pos += n
    return rows


@pytest.mark.parametrize("offsets", [True, False])
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.03, 0.5, 1.0])
@pytest.mark.parametrize("dtype, unit", [(torch.bfloat16, 2), (torch.float32, 4), (torch.uint8, 1)])
def test_a_record_applied_leaves_exactly_the_new_bytes(device, fraction, dtype, unit, offsets):
    gen = torch.Generator().manual_seed(1)
    old = [torch.randn(n, generator=gen).to(dtype).to(device) for n in (1000, 37, 4096)]
    new = [_changed(p.cpu(), fraction, k).to(device) for k, p in enumerate(old)]
    rank = Rank(old, device)
    found, bases = _find(old, new, unit)
    expect = sum(int((a.view(torch.uint8).view(ir._dtype(unit)) != b.view(torch.uint8).view(ir._dtype(unit))).sum())
                 for a, b in zip(old, new))
    assert found.count == expect
    for b, p in zip(bases, new):  # the base follows
        assert torch.equal(b, p.reshape(-1).view(torch.uint8))
    if found.count:
        rank.write(found, _table(rank, old, unit))
    assert rank.apply(offsets)["records"] == (1 if found.count else 0)
    for k, p in enumerate(new):
        assert torch.equal(rank.param(k, p).view(torch.uint8), p.view(torch.uint8)), f"param {k}"


def _one(device: str = "cpu"):
    gen = torch.Generator().manual_seed(2)
    old = [torch.randn(512, generator=gen).bfloat16().to(device), torch.randn(64, generator=gen).bfloat16().to(device)]
    new = [_changed(p.cpu(), 0.05, 3 + k).to(device) for k, p in enumerate(old)]
    rank = Rank(old, device)
    found, _ = _find(old, new, 2)
    return old, rank, found


def _refused(rank: Rank, old: list, match: str, manifest: Manifest | None = None) -> None:
    """Refused with and without offsets (unless ``manifest`` is given), the weights untouched."""
    before = rank.weights.clone()
    for offsets in ([True] if manifest is not None else [True, False]):
        with pytest.raises(InvalidWrite, match=match):
            rank.apply(offsets, manifest)
        assert torch.equal(rank.weights, before), "a refused area changed the weights"
    for k, p in enumerate(old):
        assert torch.equal(rank.param(k, p), p)


def test_a_payload_changed_after_the_owner_wrote_it_is_refused():
    old, rank, found = _one()
    rank.write(found, _table(rank, old, 2))
    at = rank.cursor - 8
    rank.area.array[at] ^= 1  # a late or stale write into the payload
    _refused(rank, old, "SHA-256 differs")


def test_a_table_changed_after_the_owner_wrote_it_is_refused():
    old, rank, found = _one()
    rank.write(found, _table(rank, old, 2))
    rank.area.array[PREFIX.size + ir.HEADER.size + ir.ENTRY.size + 16] ^= 0x02  # row 1's dest, 2 bytes over
    _refused(rank, old, "SHA-256 differs")


def test_a_destination_outside_the_weights_is_refused():
    old, rank, found = _one()
    table = _table(rank, old, 2)
    table[1] = (table[1][0], table[1][1], rank.weights.data_ptr() + rank.weights.numel() - 8)
    rank.write(found, table)
    _refused(rank, old, "outside this rank's weights")


def test_positions_out_of_order_or_past_the_table_are_refused():
    old, rank, found = _one()

    def swap(payload):
        pos = payload[:4 * found.count].view(torch.int32)
        pos[0], pos[1] = int(pos[1]), int(pos[0])

    rank.write(found, _table(rank, old, 2), payload_edit=swap)
    _refused(rank, old, "not ascending")
    old, rank, found = _one()

    def past(payload):
        payload[:4 * found.count].view(torch.int32)[-1] = 512 + 64

    rank.write(found, _table(rank, old, 2), payload_edit=past)
    _refused(rank, old, "not ascending inside")


def test_a_table_that_does_not_tile_the_positions_is_refused():
    old, rank, found = _one()
    table = _table(rank, old, 2)
    table[1] = (table[1][0] + 1, table[1][1], table[1][2])
    rank.write(found, table)
    _refused(rank, old, "table row 1 starts at")


def test_one_bad_record_refuses_the_good_ones_before_them():
    old, rank, found = _one()
    rank.write(found, _table(rank, old, 2))
    good_end = rank.cursor
    rank.write(found, _table(rank, old, 2), head_edit=lambda h: h[:PREFIX.size] + b"P2PY" + h[PREFIX.size + 4:])
    assert good_end < rank.cursor
    _refused(rank, old, f"the record at byte {good_end}")


def _three(device: str = "cpu", gap: int = 0, back: int = 0):
    """Three records of one change set, ``gap`` bytes of zeros after the first (or the second written
    ``back`` bytes into the first): the weights they were made for, the rank."""
    old, rank, found = _one(device)
    for k in range(3):
        rank.write(found, _table(rank, old, 2))
        if k == 0:
            rank.cursor += gap - back
    return old, rank


@pytest.mark.parametrize("forge", ["into a record", "not ascending", "first past 0", "past the bytes", "bytes past the last",
                                   "one offset short"])
def test_offsets_that_do_not_chain_are_refused_before_any_byte_is_applied(forge):
    old, rank = _three()
    o, m = list(rank.starts), rank.manifest()
    if forge == "into a record":  # record 1 begins 8 bytes into its payload: record 0 would not end there
        o[1] += 8
    elif forge == "not ascending":
        o[1], o[2] = o[2], o[1]
    elif forge == "first past 0":
        o[0] = 8
    elif forge == "past the bytes":
        o[2] = m.bytes
    elif forge == "bytes past the last":  # the last record does not end at the manifest's bytes
        m = Manifest(m.bytes + 8, m.records, m.sha256, m.offsets)
    elif forge == "one offset short":
        o = o[:2]
    _refused(rank, old, "do not chain|offsets", Manifest(m.bytes, m.records, m.sha256, tuple(o))
             if forge != "bytes past the last" else m)


def test_a_gap_between_records_is_refused_though_the_digest_covers_only_the_records():
    old, rank = _three(gap=64)  # the gap's bytes are no record's: the digest does not cover them
    _refused(rank, old, "do not chain", rank.manifest())


def test_a_record_written_over_the_end_of_the_one_before_it_is_refused():
    old, rank = _three(back=8)  # record 1 overlaps record 0's last payload word
    _refused(rank, old, "do not chain", rank.manifest())


def test_a_payload_whose_checksum_is_not_the_owners_is_refused():
    old, rank, found = _one()
    rank.write(found, _table(rank, old, 2))
    rank.checks[-1] = ir.checksum(torch.zeros(8, dtype=torch.uint8))  # the owner's word names another payload
    _refused(rank, old, "SHA-256 differs")


def test_the_owners_offsets_and_the_walk_find_the_same_records():
    old, rank = _three()
    walked = rank.area.check(rank.manifest(False), rank.regions, [rank.weights])[0]
    named = rank.area.check(rank.manifest(True), rank.regions, [rank.weights])[0]
    assert [r[1].at for r in walked] == [r[1].at for r in named] == rank.starts
    assert [r[1].rows for r in walked] == [r[1].rows for r in named]


def test_a_table_larger_than_the_first_window_is_read_whole():
    gen = torch.Generator().manual_seed(4)
    old = [torch.randn(8, generator=gen).bfloat16() for _ in range(200)]  # 200 rows: past a 4 KiB window
    new = [_changed(p, 0.3, 40 + k) for k, p in enumerate(old)]
    rank = Rank(old, "cpu")
    found, _ = _find(old, new, 2)
    rank.write(found, _table(rank, old, 2))
    rank.apply()
    for k, p in enumerate(new):
        assert torch.equal(rank.param(k, p).view(torch.uint8), p.view(torch.uint8)), f"param {k}"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU area needs CUDA (runs on the GPU machine)")
def test_a_gpu_area_takes_index_records_only():
    from p2pweights.deltas.codec import encode

    old, rank, found = _one("cuda")
    cur = torch.randn(64).bfloat16().view(torch.uint8).numpy()
    record = encode(cur, cur.copy(), 2)
    data = record.data.tobytes()
    prefix = PREFIX.pack(rank.weights.data_ptr(), len(data))
    body = prefix + data + b"\0" * (-len(data) % 8)
    rank.area.tensor[:len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8).cuda()
    rank.cursor, rank.records, rank.starts = len(body), 1, [0]
    rank.hash.update(body)
    _refused(rank, old, "not an index record")


@pytest.mark.parametrize("device", DEVICES)
def test_more_changes_than_the_limit_make_a_dense_record_and_the_bases_still_follow(device):
    gen = torch.Generator().manual_seed(5)
    old = [torch.randn(n, generator=gen).bfloat16().to(device) for n in (700, 300)]
    new = [_changed(p.cpu(), 0.2, 9 + k).to(device) for k, p in enumerate(old)]
    slot, so = _laid_out(new, 512)
    base, bo = _laid_out(old, 256)
    params = [(s, b, p.numel() * 2) for s, b, p in zip(so, bo, new)]
    found = ir.find_changes(slot, base, params, 2, limit=10)
    assert found.count > 10 and found.positions is None  # dense: no positions gathered
    for b, p in zip(bo, new):
        assert torch.equal(base[b:b + p.numel() * 2], p.view(torch.uint8))
    again = ir.find_changes(slot, base, params, 2, limit=10)
    assert again.count == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("unit", [1, 2, 4])
def test_the_word_compare_finds_what_the_element_compare_finds(device, unit):
    """Parameters on 8-byte boundaries are compared in words first: the same positions and values
    as element by element (a parameter of an odd size takes the element path)."""
    dtype = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}[unit]
    gen = torch.Generator().manual_seed(11)
    for sizes in ((4096, 1024), (4095, 1024)):  # the second: not a multiple of 8 bytes at unit 1 or 2
        old = [torch.randn(n, generator=gen).to(dtype).to(device) for n in sizes]
        new = [_changed(p.cpu(), 0.02, 20 + k).to(device) for k, p in enumerate(old)]
        found, _ = _find(old, new, unit)
        flat_old = torch.cat([p.reshape(-1).view(torch.uint8).view(ir._dtype(unit)) for p in old])
        flat_new = torch.cat([p.reshape(-1).view(torch.uint8).view(ir._dtype(unit)) for p in new])
        expect = (flat_old != flat_new).nonzero().squeeze(1)
        assert torch.equal(found.positions.long(), expect)
        assert torch.equal(found.values, flat_new[expect])


# -- one wait per slot: every record of a slot counted, their counts read at once, then gathered ---------
def _records(device: str):
    """Five records over one slot and one base (disjoint): BF16 at 1%, FP32 unchanged, uint8 at 100%
    (dense at a limit), BF16 of an odd size (compared element by element), int64 (unit 8) at 3%."""
    gen = torch.Generator().manual_seed(21)
    specs = [(torch.bfloat16, 2, (3000, 517), 0.01, None), (torch.float32, 4, (800,), 0.0, None),
             (torch.uint8, 1, (4096,), 1.0, 100), (torch.bfloat16, 2, (1001, 9), 0.05, None),
             (torch.int64, 8, (640,), 0.03, None)]
    new, old, records = [], [], []
    for dtype, unit, sizes, fraction, limit in specs:
        first = len(new)
        for n in sizes:
            p = torch.randint(0, 100, (n,), generator=gen).to(dtype)
            old.append(p.to(device))
            new.append(_changed(p, fraction, len(new)).to(device))
        records.append((unit, first, len(new), limit))
    slot, so = _laid_out(new, 512)
    base, bo = _laid_out(old, 256)
    params = [(s, b, p.numel() * p.element_size()) for s, b, p in zip(so, bo, new)]
    return slot, base, [(unit, params[a:z], limit) for unit, a, z, limit in records]


@pytest.mark.parametrize("device", DEVICES)
def test_records_counted_together_are_the_records_found_one_by_one(device):
    slot, base, records = _records(device)
    alone_base = base.clone()
    alone = [ir.find_changes(slot, alone_base, params, unit, limit) for unit, params, limit in records]
    countings = [ir.count_changes(slot, base, params, unit) for unit, params, _ in records]
    totals = ir.read_counts(countings)
    together = [ir.gather_changes(c, n, limit) for c, n, (_, _, limit) in zip(countings, totals, records)]
    assert [f.count for f in alone][:3] == [f.count for f in together][:3] and alone[0].count > 0
    assert alone[1].count == 0 and alone[2].positions is None  # unchanged; dense
    for a, t in zip(alone, together):
        assert (a.unit, a.elements, a.count) == (t.unit, t.elements, t.count)
        assert (a.positions is None) == (t.positions is None)
        if a.positions is not None:
            assert torch.equal(a.positions, t.positions) and torch.equal(a.values, t.values)
    assert torch.equal(base, alone_base)  # the bases moved on alike
    for _, params, _ in records:
        for s, b, n in params:
            assert torch.equal(base[b:b + n], slot[s:s + n])


class SenderSlot:
    """A sender's index-record writes (sender/delta_writes.py) of one slot of real TransferBuffers on
    ``device``: two prepared engine ranks of one engine (TP2), each loading the parameters of
    ``specs`` [(name, dtype, numel)] into the slot. The target ranks' weights and delta areas are
    addresses only: the test reads what the rows would put on the wire, from the slot."""

    def __init__(self, device: str, specs: list, seed: int = 0):
        from p2pweights.control import SglangEngine
        from p2pweights.sender.buffers import TransferBuffers, slot_size
        from p2pweights.sender.delta_writes import DeltaBases
        from p2pweights.sender.fillers import HostSlotFiller
        from p2pweights.sender.prepared import EngineTarget, PreparedRank
        from p2pweights.transport.publication import EnginePublication, ParamTarget

        gen = torch.Generator().manual_seed(seed)
        self.engine = SglangEngine("http://127.0.0.1:9", name="e")
        self.ranks, self.entries, self.values, at = [], [], [], 0
        for r in range(2):
            entries, values, table = [], [], {}
            for k, (name, dtype, numel) in enumerate(specs):
                n = numel * torch.empty(0, dtype=dtype).element_size()
                entries.append((name, at, n))
                values.append(torch.randint(0, 100, (numel,), generator=gen).to(dtype))
                table[name] = ParamTarget(0x7000_0000 + r * (1 << 24) + k * (1 << 20), numel, n // numel)
                at += -(-n // 256) * 256
            pub = EnginePublication("nixl", "peer", table, rank=r, delta_area=(0x9000_0000 + r * (1 << 24), 1 << 24))
            self.ranks.append(PreparedRank("tp=2", r, None, None, [EngineTarget(self.engine, r, r, pub)]))
            self.entries.append(entries)
            self.values.append(values)
        # an aligned slot, as a sender asks for: GPU slots take their spare from the rounding up
        self.buffers = TransferBuffers(slot_size(at), 1, pin="none", device=device, spare_bytes=1 << 20)
        assert self.buffers.spare_bytes >= 1 << 20
        self.bases = DeltaBases()
        self.filler = HostSlotFiller(None)
        self.filler.slot = 0
        self.updates = 0
        self.load()

    def change(self, fractions: list, seed: int) -> None:
        """Rank r's k-th parameter changes in ``fractions[r][k]`` of its elements (loaded into the slot)."""
        self.values = [[_changed(v, f, seed + 7 * k + r) for k, (v, f) in enumerate(zip(vs, fs))]
                       for r, (vs, fs) in enumerate(zip(self.values, fractions))]
        self.load()

    def load(self) -> None:
        slot = self.buffers.slot_tensor(0)
        for entries, values in zip(self.entries, self.values):
            for (_, o, n), v in zip(entries, values):
                slot[o:o + n] = v.reshape(-1).view(torch.uint8).to(slot.device)

    def update(self, batched: bool = True) -> tuple:
        """One update's slot: the first writes in full; later ones take deltas. ``batched``: as the
        pipeline runs (every rank's rows, then the slot's records at its close); else each record
        gathered alone, right after its rank's rows of one element size (one wait per record)."""
        from p2pweights.deltas.committed import DELTA_KEY
        from p2pweights.sender.delta_writes import UpdateDeltas

        if self.updates:
            self.bases.identities[self.engine.name] = {"epoch": 1, "token": "t"}  # the last commit's
        self.updates += 1
        d = UpdateDeltas(self.bases, self.ranks, self.buffers, wanted=True)
        d.claim([self.engine])
        d.opened({self.engine.name: {DELTA_KEY: {"accepted": True}}})
        d.new_slot()
        rows = []
        for p, entries in zip(self.ranks, self.entries):
            units = {e[2] // p.targets[0].publication.params[e[0]].numel for e in entries}
            groups = [entries] if batched else [[e for e in entries if e[2] // p.targets[0].publication.params[
                e[0]].numel == u] for u in sorted(units)]
            for group in groups:
                rows += d.slot_rows(p, group, self.filler)
                rows += [] if batched else d.slot_records()
        rows += d.slot_records()
        return d, rows

    def wire(self, rows: list) -> list:
        """What each row puts at its remote address: (remote, bytes), sorted."""
        whole = torch.cat([self.buffers.slot_tensor(0), self.buffers.spare_tensor(0)]).cpu()
        return sorted((remote, whole[o:o + n].numpy().tobytes()) for o, n, _, remote in rows)


SPECS = [("a", torch.bfloat16, 30000), ("b", torch.float32, 5000), ("c", torch.bfloat16, 777 * 8),
         ("d", torch.float32, 2000)]
#: rank 0: BF16 sparse, FP32 sparse; rank 1: BF16 dense (b), FP32 unchanged: sparse, dense and empty records
FRACTIONS = [[0.01, 0.02, 0.005, 0.03], [1.0, 0.0, 0.02, 0.0]]


@pytest.mark.parametrize("device", DEVICES)
def test_a_slot_gathered_at_its_close_writes_what_records_gathered_one_by_one_write(device, monkeypatch):
    """The batched slot (kernels, on a GPU) against each record alone (torch, on a GPU): the same
    rows, the same bytes on the wire, the same manifests and bases."""
    from p2pweights.deltas import kernels
    from p2pweights.sender import delta_writes

    monkeypatch.setattr(delta_writes, "INDEX_RECORDS_ON_HOST", True)
    got = []
    for batched in (True, False):
        monkeypatch.setattr(kernels, "ENABLED", batched)
        s = SenderSlot(device, SPECS, seed=3)
        first, rows = s.update(batched)
        assert first.reasons() == {"e/rank0": delta_writes.FIRST, "e/rank1": delta_writes.FIRST}
        s.change(FRACTIONS, seed=5)
        d, rows = s.update(batched)
        assert d.reasons() == {"e/rank0": "", "e/rank1": ""}
        bases = [b.cpu().clone() for b, _ in s.bases.ranks.values()]
        got.append((rows, s.wire(rows), d.written(), d.encoded, bases, s))
    (rows, wire, written, encoded, bases, s), (rows1, wire1, written1, encoded1, bases1, _) = got
    assert rows == rows1 and wire == wire1 and written == written1 and encoded == encoded1
    assert all(torch.equal(a, b) for a, b in zip(bases, bases1))
    records = {r: sum(m["records"] for m in ms) for r, ms in written["e"].items()}
    assert records == {"0": 2, "1": 0}, records  # rank 1: its BF16 record dense, its FP32 one empty
    for r, entries in enumerate(s.entries):  # the bases hold what the slot held
        base, offsets = s.bases.ranks[("tp=2", r)]
        for (name, _, n), v in zip(entries, s.values[r]):
            assert torch.equal(base[offsets[name]:offsets[name] + n].cpu(), v.reshape(-1).view(torch.uint8))


GPU_KERNELS = torch.cuda.is_available() and _native.delta_kernels_embedded()
SLEEP = 2_000_000_000  # GPU cycles (about a second): the device stays busy while the host builds the slot


@pytest.mark.skipif(not GPU_KERNELS, reason="needs a CUDA device and the native module's delta kernels")
def test_a_gpu_slot_waits_for_the_device_once_whatever_its_records(monkeypatch):
    """Every torch synchronization is counted (sync debug mode), and the device is kept busy before
    the counts are read and again after: a wait anywhere else (a driver's wait included) finds it idle."""
    import warnings

    s = SenderSlot("cuda", SPECS, seed=4)
    s.update()  # in full: the bases
    s.change(FRACTIONS, seed=6)
    s.update()  # deltas: the records' spans are kept from here on
    s.change(FRACTIONS, seed=8)
    stream, reads, real = torch.cuda.current_stream(), [], ir.read_counts

    def read_counts(countings):
        reads.append((len(countings), stream.query()))  # still busy: nothing before the read waited
        out = real(countings)
        torch.cuda._sleep(SLEEP)  # busy again: a wait after the read would find it idle
        return out

    monkeypatch.setattr(ir, "read_counts", read_counts)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP)
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            d, rows = s.update()
            busy = not stream.query()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert reads == [(4, False)] and busy, (reads, busy)  # two ranks x two element sizes, one read
    assert len(syncs) == 1, syncs
    torch.cuda.synchronize()
    assert {r: sum(m["records"] for m in ms) for r, ms in d.written()["e"].items()} == {"0": 2, "1": 0} and rows


@pytest.mark.parametrize("records", ["runs", "index"])
def test_a_host_slot_filled_through_gpu_staging_takes_deltas_and_the_engine_holds_the_checkpoint(tmp_path, monkeypatch,
                                                                                                 records):
    """GPU tensors into host slots (StagedHostSlotFiller) through the real slot pipeline and the
    loopback transport, into an engine rank's weights and host delta area. The staging is
    test_sender_pipeline's CPU stand-in: a copy to the host slot lands only when its event (or a later
    one) is synchronized, so a compare that read the slot before its copies landed would write records
    of stale bytes. After the first update (full), each steady update waits once a slot and writes only
    what changed (nothing when nothing did), the report names no reason, no slot reaches the writer
    before its copies, and after every update the engine's bytes are what the loaders make of the
    checkpoint. A delta=False update does not wait for the copies and keeps no base: the update after
    it is written in full and says why (STAGED), the one after that takes deltas again. "index": the
    records a GPU area takes (index records, built on the host slot), as for an engine on a GPU."""
    from p2pweights.control import SglangEngine
    from p2pweights.deltas.area import DeltaArea
    from p2pweights.deltas.committed import DELTA_KEY
    from p2pweights.models.checkpoint import random_checkpoint
    from p2pweights.replica import EngineLayout, model_replicas
    from p2pweights.sender import delta_writes
    from p2pweights.sender.buffers import TransferBuffers, slot_size
    from p2pweights.sender.delta_bases import DeltaBases, spare_bytes
    from p2pweights.sender.delta_writes import FIRST, STAGED, UpdateDeltas
    from p2pweights.sender.fillers import SlotHandOver, StagedHostSlotFiller
    from p2pweights.sender.pipeline import SlotPipeline
    from p2pweights.sender.prepared import EngineTarget, PreparedRank
    from p2pweights.sender.report import UpdateTimes
    from p2pweights.sender.stager import GroupStager
    from p2pweights.sender.transforms import GroupLoad
    from p2pweights.transport import params_table, writable_regions
    from p2pweights.transport.publication import EnginePublication
    from replica_configs import write_config
    from test_sender_pipeline import _assert_bytes_equal, _CheckedWriter, _FakeStaging, _param_memory, _reference

    monkeypatch.setattr(delta_writes, "INDEX_RECORDS_ON_HOST", records == "index")
    cfg = write_config("qwen3", str(tmp_path), hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                       vocab_size=4096)  # one engine rank of tp=2: about 7 MiB, several 1 MiB slots an update
    layout = EngineLayout.parse("tp=2")
    replica = model_replicas().get(cfg, layout, 0)
    slot = slot_size(1 << 20, replica.largest_group_nbytes)
    buffers = TransferBuffers(slot, 2, pin="none", spare_bytes=spare_bytes(slot))
    transport = _native.LoopbackTransport()
    transport.register_memory(buffers.address, buffers.total_bytes)
    writer = _CheckedWriter(transport, buffers, transfer_timeout=10)
    region, views = _param_memory(replica.param_specs)
    area = DeltaArea(region.numel(), engine="fake")
    pub = EnginePublication.from_json({"remote_instance_transfer_engine_info": ["loopback", params_table(views.items())],
                                       "delta_area": area.published()})
    engine = SglangEngine("http://fake:1", name="fake")
    staging = _FakeStaging(buffers.slot_bytes)
    writer.ready = lambda slot: all(e.host != buffers.slot_address(slot) for e in staging.stream.queued)
    bases = DeltaBases()
    tensors = {n: t.clone() for n, t in random_checkpoint(replica.hf_specs, 5)}
    try:
        transport.connect(0, "loopback")
        writer.add_engine(0, "fake/rank0", writable_regions(pub, "fake/rank0"))
        rank = PreparedRank(layout.key, 0, replica, GroupStager([g.hf_names for g in replica.groups], replica.hf_specs),
                            [EngineTarget(engine, 0, 0, pub)])
        # (changed, delta, the reason reported): full first; deltas; a delta=False update (no wait for the
        # copies, no base kept), the update after it in full (STAGED), then deltas again
        steps = [(None, True, FIRST), (0.01, True, ""), (0.0, True, ""), (0.01, True, ""),
                 (0.01, False, "delta=False"), (0.01, True, STAGED), (0.01, True, "")]
        slots = 0
        for step, (fraction, delta, why) in enumerate(steps):
            if fraction:
                tensors = {n: _changed(t, fraction, 100 * step + k) for k, (n, t) in enumerate(tensors.items())}
            if step:
                bases.identities[engine.name] = {"epoch": 1, "token": "t"}  # the last commit's
            times = UpdateTimes()
            handover = SlotHandOver(writer, times)
            filler = StagedHostSlotFiller(handover, lambda device: staging)
            waits, landed = [], filler.landed
            filler.landed = lambda: waits.append(1) or landed()
            d = UpdateDeltas(bases, [rank], buffers, wanted=delta, off_reason="" if delta else "delta=False")
            d.claim([engine])
            d.opened({engine.name: {DELTA_KEY: {"accepted": True}}})
            pipeline = SlotPipeline(handover, lambda inputs: filler, times)
            pipeline.deltas = d
            for g in replica.groups:
                pipeline.place(GroupLoad(rank, g, {n: tensors[n] for n in g.hf_names}))
            pipeline.drain()
            written = writer.finish().bytes
            assert not staging.stream.queued  # every copy landed, none after its slot went to the writer
            full = d.full_bytes["fake/rank0"]
            reason = d.reasons()["fake/rank0"]
            if d.targets["fake/rank0"].delta:  # the engine applies its area at the end
                area.apply(Manifest.parse(d.written()["fake"]["0"][0], "rank 0"), [(region.data_ptr(), region.numel())],
                           [region])
            slots = slots or times.slots  # the first update's: every slot had writes
            assert len(waits) == (slots if delta else 0) and slots > 2, (waits, slots)  # one wait a slot, or none
            assert reason == why, (step, reason)
            if why:  # written in full
                assert written == full and d.encoded == 0 and times.slots == slots
            else:  # only what changed
                assert d.changed == 0 if fraction == 0.0 else 0 < d.changed < 0.05 * full
                assert written == d.encoded <= (0 if fraction == 0.0 else 0.1 * full), (written, full)
            _assert_bytes_equal(views, _reference(replica, tensors), f"step {step} (changed {fraction}, delta {delta})")
    finally:
        writer.close()
        transport.close()
        buffers.close()
        area.close()


@pytest.mark.parametrize("device", DEVICES)
def test_two_writers_index_records_are_checked_in_one_read_each_digest_ending_with_its_own_checksums(device):
    """Two writers (PP stages) each write index records of their own parameters into their own part
    of one area: one apply checks both segments (each digest ends with the checksums of its own
    records only) and applies both. Trading two records' checksums between the digests is refused."""
    from p2pweights.deltas.area import writer_part

    gen = torch.Generator().manual_seed(9)
    old = [torch.randn(n, generator=gen).bfloat16().to(device) for n in (700, 300, 900, 50)]
    new = [_changed(p.cpu(), 0.05, 20 + k).to(device) for k, p in enumerate(old)]
    rank = Rank(old, device)
    segments = []
    for w, ks in enumerate(([0, 1], [2, 3])):  # writer 0: params 0-1, writer 1: params 2-3
        start = writer_part(rank.area.nbytes, w, 2)[0]
        rank.cursor, rank.records, rank.hash, rank.checks, rank.starts = start, 0, hashlib.sha256(), [], []
        for k in ks:
            found, _ = _find([old[k]], [new[k]], 2)
            table = [(0, old[k].numel(), rank.weights.data_ptr() + rank.offsets[k])]
            rank.write(found, table)
        digest = rank.hash.copy()
        digest.update(ir.checksum_words(rank.checks))
        segments.append(Manifest(rank.cursor - start, rank.records, digest.hexdigest(), tuple(rank.starts), start))
    before = rank.weights.clone()
    a, b = segments
    swapped = [Manifest(a.bytes, a.records, b.sha256, a.offsets, a.start), Manifest(b.bytes, b.records, a.sha256,
                                                                                     b.offsets, b.start)]
    with pytest.raises(InvalidWrite, match="segment 0: its bytes are not the ones"):
        rank.area.apply(swapped, rank.regions, [rank.weights])
    assert torch.equal(rank.weights, before)
    figures = rank.area.apply(segments, rank.regions, [rank.weights])
    assert figures["segments"] == 2 and figures["records"] == 4
    assert figures["device_reads"] == (2 if device != "cpu" else 0)  # whatever the writers
    for k, p in enumerate(new):
        assert torch.equal(rank.param(k, p).view(torch.uint8), p.view(torch.uint8)), f"param {k}"
