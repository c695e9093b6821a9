"""An engine rank's delta area: where senders write encoded deltas one-sided, and where the rank
applies them at the end of the session (before post-processing).

Every host of an engine rank (our receiver, the sglang plugin, the vLLM backend) keeps one
:class:`DeltaArea` next to its weights, registers it with the same revocable endpoint
(transport/revocation.py: a takeover revokes it with the weights) and publishes it
(``EnginePublication.delta_area``). The area holds records one after another, each::

    dest (u64, the engine address of the parameter's first byte; 0 for an index record) | nbytes
    (u64, the record's bytes) | the record | zero padding to 8 bytes

A record is a codec record (deltas/codec.py: a host slot's varint runs; host areas only) or an index
record (deltas/index_records.py: a GPU slot's changed positions and values; any area, applied with
torch on the device of the weights). A rank whose weights are on a GPU keeps its area in GPU memory.

The session's owner names, in its end call, how many bytes and records it wrote and the SHA-256 of
what it wrote (:class:`Manifest`): every codec record's bytes, every index record's prefix, header
and table, then every index record's payload checksum (computed on the device; index_records.py). :meth:`DeltaArea.apply`
refuses the whole area unless the bytes are exactly those, every record passes its checks and every
destination lies inside the rank's weight regions — before the first byte is applied. A refused
apply fails the end: the engine is torn, as after any failed update (docs/deltas.md).
"""
from __future__ import annotations

import hashlib
import mmap
import struct
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .. import _native
from ..errors import InvalidWrite, OutOfRegion, raise_for_status
from . import index_records
from .codec import HEADER, HEADER_BYTES

#: a record's prefix: destination address, codec record bytes
PREFIX = struct.Struct("<QQ")
ALIGN = 8
_WINDOW = 16 << 10  # bytes of a GPU area read per record: the prefix, header and a table of 680 rows


def record_span(nbytes: int) -> int:
    """Bytes one record of an ``nbytes`` codec record takes in the area (prefix and padding)."""
    return PREFIX.size + -(-int(nbytes) // ALIGN) * ALIGN


@dataclass(frozen=True)
class Manifest:
    """What the owner wrote into one rank's area in this session (sent in its end call)."""

    bytes: int
    records: int
    sha256: str

    def to_dict(self) -> dict:
        return {"bytes": self.bytes, "records": self.records, "sha256": self.sha256}

    @classmethod
    def parse(cls, d: Any, where: str) -> "Manifest":
        """A manifest from a request body, each field type-checked (InvalidWrite names the field)."""
        if not isinstance(d, dict):
            raise InvalidWrite(f"{where}: a delta manifest must be an object, not {type(d).__name__}")
        for key in ("bytes", "records"):
            v = d.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise InvalidWrite(f"{where}: delta manifest field {key!r} must be an integer >= 0, got {v!r}")
        digest = d.get("sha256")
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise InvalidWrite(f"{where}: delta manifest field 'sha256' must be 64 lowercase hex digits")
        return cls(int(d["bytes"]), int(d["records"]), digest)


class DeltaArea:
    """``nbytes`` of page-aligned memory for one engine rank's deltas: host memory, or GPU memory
    (``device="cuda:N"``) for a rank whose weights are there."""

    def __init__(self, nbytes: int, rank: int = 0, engine: str = "engine", device: str = "cpu"):
        if int(nbytes) <= 0:
            raise ValueError(f"a delta area needs > 0 bytes, got {nbytes}")
        self.nbytes = int(nbytes)
        self.rank, self.engine, self.device = int(rank), engine, device
        self._mem: mmap.mmap | None = None
        self._raw: Any = None
        if device == "cpu":
            self._mem = mmap.mmap(-1, self.nbytes)
            self.array = np.frombuffer(self._mem, dtype=np.uint8)
            self.address = int(self.array.ctypes.data)
        else:
            import torch  # a GPU area: torch holds the memory (the native core never links torch)

            self._raw = torch.zeros(self.nbytes + mmap.PAGESIZE, dtype=torch.uint8, device=device)
            skip = (-self._raw.data_ptr()) % mmap.PAGESIZE
            self.tensor = self._raw[skip:skip + self.nbytes]
            self.array = np.empty(0, dtype=np.uint8)
            self.address = int(self.tensor.data_ptr())
        self.last: dict = {}  # the last apply's figures

    def region(self) -> tuple[int, int, str]:
        """(address, bytes, device) to register next to the weights."""
        return self.address, self.nbytes, self.device

    def published(self) -> list[int]:
        return [self.address, self.nbytes]

    def _refuse(self, cls: type, what: str) -> None:
        raise cls(f"engine {self.engine} rank {self.rank}: delta area refused, nothing applied: {what}")

    def _bytes(self, at: int, n: int) -> bytes:
        if self.device == "cpu":
            return self.array[at:at + n].tobytes()
        return self.tensor[at:at + n].cpu().numpy().tobytes()

    def _payload(self, at: int, n: int) -> Any:
        """``n`` bytes of the area from ``at`` as a uint8 tensor on the area's device (no copy)."""
        if self.device != "cpu":
            return self.tensor[at:at + n]
        import torch

        return torch.from_numpy(self.array[at:at + n])

    def check(self, manifest: Manifest, regions: Sequence[tuple[int, int]],
              tensors: Sequence[Any] = ()) -> list[tuple]:
        """Every record of the manifest's bytes, checked (``tensors``: the weight regions as uint8
        tensors, for index records): [("runs", record address, bytes, dest, dest bytes) or ("index",
        checked record)]. Raises (nothing applied) unless all of them are sound."""
        if manifest.bytes > self.nbytes:
            self._refuse(OutOfRegion, f"the manifest names {manifest.bytes} bytes; the area holds {self.nbytes}")
        digest = hashlib.sha256()
        used = self.array[:manifest.bytes] if self.device == "cpu" else None
        out: list[tuple] = []
        pos = 0
        while pos < manifest.bytes:
            if manifest.bytes - pos < PREFIX.size + HEADER_BYTES:
                self._refuse(InvalidWrite, f"a record at byte {pos} is cut short")
            # a GPU area: one read from the device per record, its prefix, header and (most) table
            first = self._bytes(pos, min(manifest.bytes - pos, _WINDOW if used is None else PREFIX.size + 4))
            dest, n = PREFIX.unpack_from(first, 0)
            span = record_span(n)
            if n < HEADER_BYTES or span > manifest.bytes - pos:
                self._refuse(InvalidWrite, f"the record at byte {pos} claims {n} bytes")
            if first[PREFIX.size:PREFIX.size + 4] == index_records.MAGIC:
                out.append(("index", self._check_index(pos, n, span, regions, tensors, digest, first)))
            elif used is None:
                self._refuse(InvalidWrite, f"the record at byte {pos} is not an index record (a GPU area takes "
                                           f"no others)")
            else:
                digest.update(used[pos:pos + span])
                out.append(("runs", *self._check_runs(used, pos, n, dest, regions)))
            pos += span
        indexed = [r[1] for r in out if r[0] == "index"]
        digest.update(index_records.checksum_words([r.checksum for r in indexed]))  # one wait for all
        if digest.hexdigest() != manifest.sha256:
            self._refuse(InvalidWrite, "its bytes are not the ones the session's owner wrote (SHA-256 differs)")
        if len(out) != manifest.records:
            self._refuse(InvalidWrite, f"the manifest names {manifest.records} records; the area holds {len(out)}")
        bad = index_records.any_bad(indexed)
        if bad:
            self._refuse(InvalidWrite, f"index record {bad[0]}: its positions are not ascending inside its table")
        return out

    def _check_runs(self, used: np.ndarray, pos: int, n: int, dest: int,
                    regions: Sequence[tuple[int, int]]) -> tuple[int, int, int, int]:
        rec = self.address + pos + PREFIX.size
        dst_nbytes = HEADER.unpack_from(used, pos + PREFIX.size)[5]
        if not any(a <= dest and dest + dst_nbytes <= a + size for a, size in regions):
            self._refuse(OutOfRegion, f"the record at byte {pos} writes [{dest:#x}, +{dst_nbytes}), outside "
                                      f"this rank's weights")
        code, message = _native.delta_check(rec, n, dst_nbytes)
        if code != int(_native.Code.OK):
            raise_for_status(code, f"engine {self.engine} rank {self.rank}: delta area refused, nothing "
                                   f"applied: the record at byte {pos}: {message}")
        return rec, n, dest, dst_nbytes

    def _check_index(self, pos: int, n: int, span: int, regions: Sequence[tuple[int, int]], tensors: Sequence[Any],
                     digest: Any, window: bytes = b"") -> Any:
        at = pos + PREFIX.size

        def read(start: int, size: int) -> bytes:  # from the window read already, else the area
            if start - pos + size <= len(window):
                return window[start - pos:start - pos + size]
            return self._bytes(start, size)

        head = read(at, index_records.HEADER.size)
        try:
            unit, entries, count, _ = index_records.parse_header(head)
            table_end = index_records.HEADER.size + index_records.ENTRY.size * entries
            if index_records.record_bytes(entries, count, unit) != n:
                raise ValueError(f"it claims {n} bytes for {entries} table rows and {count} changes")
            if len(tensors) != len(regions):
                raise ValueError("this rank gave no tensors of its weights to apply it with")
            table = read(at + index_records.HEADER.size, table_end - index_records.HEADER.size)
            digest.update(read(pos, PREFIX.size) + head + table)
            return index_records.check(head, table, self._payload(at + table_end, n - table_end),
                                       [(a, size, t) for (a, size), t in zip(regions, tensors)])
        except ValueError as e:
            self._refuse(InvalidWrite, f"the index record at byte {pos}: {e}")

    def apply(self, manifest: Manifest, regions: Sequence[tuple[int, int]], tensors: Sequence[Any] = ()) -> dict:
        """Check every record (:meth:`check`), then apply them into the weights."""
        t0 = time.perf_counter()
        records = self.check(manifest, regions, tensors)
        t1 = time.perf_counter()
        for kind, *rest in records:
            if kind == "index":
                index_records.apply(rest[0])
                continue
            rec, n, dest, dst_nbytes = rest
            code, message = _native.delta_apply(rec, n, dest, dst_nbytes)
            if code != int(_native.Code.OK):  # checked above: a failure here is a bug; the end fails (torn)
                raise_for_status(code, f"engine {self.engine} rank {self.rank}: applying a delta record: {message}")
        if self.device != "cpu" and records:
            import torch

            torch.cuda.synchronize(self.device)  # applied before the end's post-processing reads them
        self.last = {"records": len(records), "bytes": manifest.bytes, "check_s": round(t1 - t0, 6),
                     "apply_s": round(time.perf_counter() - t1, 6)}
        return dict(self.last)

    def close(self) -> None:
        self._raw = None
        self.tensor = None
        if self._mem is not None:
            self.array = np.empty(0, dtype=np.uint8)
            try:
                self._mem.close()
            except BufferError:  # a view is still alive; the mapping goes with it
                pass
            self._mem = None


def area_bytes(weight_bytes: int, setting_value: int | None) -> int:
    """The area of a rank holding ``weight_bytes``: ``P2PW_DELTA_AREA`` when set, else an eighth of
    the weights (at least 4 MiB), rounded up to the page size."""
    n = int(setting_value) if setting_value else max(4 << 20, int(weight_bytes) // 8)
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE
