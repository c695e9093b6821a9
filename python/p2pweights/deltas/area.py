"""An engine rank's delta area: where senders write encoded deltas one-sided, and where the rank
applies them at the end of the session (before post-processing).

Every host of an engine rank (our receiver, the sglang plugin, the vLLM backend) keeps one
:class:`DeltaArea` next to its weights, registers it with the same revocable endpoint
(transport/revocation.py: a takeover revokes it with the weights) and publishes it
(``EnginePublication.delta_area``). The area holds records one after another, each::

    dest (u64, the engine address of the parameter's first byte) | nbytes (u64, the codec record's
    bytes) | the codec record (deltas/codec.py: header + payload) | zero padding to 8 bytes

The session's owner names, in its end call, how many bytes and records it wrote and their SHA-256
(:class:`Manifest`); :meth:`DeltaArea.apply` refuses the whole area unless the bytes are exactly
those, every record passes the codec's checks and every destination lies inside the rank's weight
regions — before the first byte is applied. A refused apply fails the end: the engine is torn, as
after any failed update (docs/deltas.md).
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
from .codec import HEADER, HEADER_BYTES

#: a record's prefix: destination address, codec record bytes
PREFIX = struct.Struct("<QQ")
ALIGN = 8


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
    """``nbytes`` of page-aligned host memory for one engine rank's deltas."""

    def __init__(self, nbytes: int, rank: int = 0, engine: str = "engine"):
        if int(nbytes) <= 0:
            raise ValueError(f"a delta area needs > 0 bytes, got {nbytes}")
        self.nbytes = int(nbytes)
        self.rank, self.engine = int(rank), engine
        self._mem: mmap.mmap | None = mmap.mmap(-1, self.nbytes)
        self.array = np.frombuffer(self._mem, dtype=np.uint8)
        self.address = int(self.array.ctypes.data)
        self.last: dict = {}  # the last apply's figures

    def region(self) -> tuple[int, int, str]:
        """(address, bytes, device) to register next to the weights."""
        return self.address, self.nbytes, "cpu"

    def published(self) -> list[int]:
        return [self.address, self.nbytes]

    def _refuse(self, cls: type, what: str) -> None:
        raise cls(f"engine {self.engine} rank {self.rank}: delta area refused, nothing applied: {what}")

    def check(self, manifest: Manifest, regions: Sequence[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
        """Every record of the manifest's bytes, checked: [(record address, record bytes, dest, dest
        bytes)]. Raises (nothing applied) unless all of them are sound."""
        if manifest.bytes > self.nbytes:
            self._refuse(OutOfRegion, f"the manifest names {manifest.bytes} bytes; the area holds {self.nbytes}")
        used = self.array[:manifest.bytes]
        if hashlib.sha256(used).hexdigest() != manifest.sha256:
            self._refuse(InvalidWrite, "its bytes are not the ones the session's owner wrote (SHA-256 differs)")
        out, pos = [], 0
        while pos < manifest.bytes:
            if manifest.bytes - pos < PREFIX.size + HEADER_BYTES:
                self._refuse(InvalidWrite, f"a record at byte {pos} is cut short")
            dest, n = PREFIX.unpack_from(used, pos)
            span = record_span(n)
            if n < HEADER_BYTES or span > manifest.bytes - pos:
                self._refuse(InvalidWrite, f"the record at byte {pos} claims {n} bytes")
            rec = self.address + pos + PREFIX.size
            dst_nbytes = HEADER.unpack_from(used, pos + PREFIX.size)[5]
            if not any(a <= dest and dest + dst_nbytes <= a + size for a, size in regions):
                self._refuse(OutOfRegion, f"the record at byte {pos} writes [{dest:#x}, +{dst_nbytes}), outside "
                                          f"this rank's weights")
            code, message = _native.delta_check(rec, n, dst_nbytes)
            if code != int(_native.Code.OK):
                raise_for_status(code, f"engine {self.engine} rank {self.rank}: delta area refused, nothing "
                                       f"applied: the record at byte {pos}: {message}")
            out.append((rec, n, dest, dst_nbytes))
            pos += span
        if len(out) != manifest.records:
            self._refuse(InvalidWrite, f"the manifest names {manifest.records} records; the area holds {len(out)}")
        return out

    def apply(self, manifest: Manifest, regions: Sequence[tuple[int, int]]) -> dict:
        """Check every record (:meth:`check`), then apply them into host weight memory."""
        t0 = time.perf_counter()
        records = self.check(manifest, regions)
        t1 = time.perf_counter()
        for rec, n, dest, dst_nbytes in records:
            code, message = _native.delta_apply(rec, n, dest, dst_nbytes)
            if code != int(_native.Code.OK):  # checked above: a failure here is a bug; the end fails (torn)
                raise_for_status(code, f"engine {self.engine} rank {self.rank}: applying a delta record: {message}")
        self.last = {"records": len(records), "bytes": manifest.bytes, "check_s": round(t1 - t0, 6),
                     "apply_s": round(time.perf_counter() - t1, 6)}
        return dict(self.last)

    def close(self) -> None:
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
