"""One slot's delta record: encoded on the sender, checked and applied on the engine rank.

The native codec (csrc/buffers/delta_codec.h, where the byte layout is written down) compares the
bytes about to be written into a slot (``cur``) with the bytes last committed there (``base``) in
units of ``unit`` bytes (2 for BF16) and writes a self-describing record: EMPTY when nothing
changed, RUNS (each run: varint gap, varint length, its bytes) when that is smaller than the slot,
DENSE (the slot's bytes) otherwise. :func:`apply` checks the whole record (header, checksum, every
run inside the slot) before the first byte lands; a refused record raises the typed exception of its
status code (:class:`~p2pweights.errors.InvalidWrite`, :class:`~p2pweights.errors.OutOfRegion`)
and leaves ``dst`` untouched.

Buffers are numpy arrays, torch CPU tensors (both C-contiguous), bytes, bytearrays or memoryviews;
the native calls get their addresses and run with the GIL released.
"""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import _native
from ..errors import InvalidWrite, raise_for_status

MAGIC = b"P2PD"
VERSION = 1
HEADER_BYTES = 48
#: the header's fields in order (little-endian): magic, version, mode, unit, reserved, slot_nbytes,
#: payload_bytes, run_count, checksum
HEADER = struct.Struct("<4sHHIIQQQQ")
MODES = ("empty", "runs", "dense")
UNITS = (1, 2, 4, 8)


@dataclass(frozen=True)
class DeltaStats:
    """What one encode found: ``changed_bytes`` of the slot's ``slot_bytes`` differ from the base;
    the record takes ``encoded_bytes`` (header included) in ``mode`` with ``runs`` runs."""

    slot_bytes: int
    encoded_bytes: int
    changed_bytes: int
    runs: int
    mode: str

    @property
    def ratio(self) -> float:
        """Encoded bytes over the slot's bytes: what a delta write costs against a full one."""
        return self.encoded_bytes / self.slot_bytes if self.slot_bytes else 0.0


@dataclass(frozen=True)
class DeltaRecord:
    """A record's bytes (a uint8 view of the output buffer) and what the encode found."""

    data: np.ndarray
    stats: DeltaStats

    def __len__(self) -> int:
        return int(self.data.nbytes)

    def __bytes__(self) -> bytes:
        return self.data.tobytes()


@dataclass(frozen=True)
class RecordHeader:
    """A record's header fields as they are, unchecked (:func:`check` validates them)."""

    magic: bytes
    version: int
    mode: int
    unit: int
    reserved: int
    slot_nbytes: int
    payload_bytes: int
    run_count: int
    checksum: int

    @property
    def mode_name(self) -> str:
        return MODES[self.mode] if self.mode < len(MODES) else f"unknown({self.mode})"


def _span(buf: Any, what: str, writable: bool = False) -> tuple[int, int, Any]:
    """(address, bytes, the object that keeps them alive) of a contiguous host buffer."""
    if isinstance(buf, DeltaRecord):
        buf = buf.data
    if isinstance(buf, (bytes, bytearray, memoryview)):
        buf = np.frombuffer(buf, dtype=np.uint8)
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise InvalidWrite(f"{what} is not C-contiguous")
        if writable and not buf.flags.writeable:
            raise InvalidWrite(f"{what} is read-only")
        return int(buf.ctypes.data), int(buf.nbytes), buf
    if hasattr(buf, "data_ptr") and hasattr(buf, "element_size"):  # a torch tensor, without importing torch
        if buf.device.type != "cpu":
            raise InvalidWrite(f"{what} is on {buf.device}: the host codec reads and writes host memory")
        if not buf.is_contiguous():
            raise InvalidWrite(f"{what} is not contiguous")
        return int(buf.data_ptr()), int(buf.numel()) * int(buf.element_size()), buf
    raise TypeError(f"{what}: a numpy array, a CPU torch tensor or a bytes-like object, not {type(buf).__name__}")


def _raise(code: int, message: str) -> None:
    if code != int(_native.Code.OK):
        raise_for_status(code, message)


def max_encoded(nbytes: int) -> int:
    """The most bytes the record of an ``nbytes`` slot takes (header + nbytes: DENSE caps it)."""
    return int(_native.delta_max_encoded(int(nbytes)))


def encode(cur: Any, base: Any, unit: int = 2, *, update_base: bool = False, threads: int = 1,
           out: np.ndarray | bytearray | memoryview | None = None) -> DeltaRecord:
    """The record of ``cur`` against ``base`` (equal sizes). ``update_base``: base := cur on the
    way (only the changed bytes are written). ``out``: a 1-D uint8 array (or bytearray) of at least
    :func:`max_encoded` bytes to encode into, e.g. a delta area (a fresh array otherwise); the
    record is a view of it, valid until ``out`` is written again.
    ``threads``: parts of at least 1 MiB scanned side by side (the record is the same for any count)."""
    c_addr, c_len, _c = _span(cur, "cur")
    b_addr, b_len, _b = _span(base, "base", writable=update_base)
    if c_len != b_len:
        raise InvalidWrite(f"cur has {c_len} bytes and base {b_len}")
    if out is None:
        out = np.empty(max_encoded(c_len), dtype=np.uint8)
    elif isinstance(out, (bytearray, memoryview)):
        out = np.frombuffer(out, dtype=np.uint8)
    if not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.ndim != 1:
        raise InvalidWrite("out must be a 1-D uint8 numpy array (a torch tensor's .numpy()) or a bytearray")
    o_addr, o_len, _o = _span(out, "out", writable=True)
    code, message, encoded, changed, runs, mode = _native.delta_encode(
        c_addr, b_addr, c_len, int(unit), o_addr, o_len, bool(update_base), int(threads))
    _raise(code, message)
    return DeltaRecord(out[:encoded], DeltaStats(c_len, encoded, changed, runs, mode))


def check(record: Any, dst_nbytes: int) -> None:
    """Validates a record for a destination of ``dst_nbytes`` bytes without applying it: raises
    InvalidWrite (malformed, corrupted) or OutOfRegion (another slot size, a run outside the slot)."""
    r_addr, r_len, _r = _span(record, "record")
    _raise(*_native.delta_check(r_addr, r_len, int(dst_nbytes)))


def apply(record: Any, dst: Any, *, checked: bool = False) -> None:
    """Checks the record against ``dst``, then writes its runs there; a refused record raises (as
    :func:`check`) with nothing written. ``checked=True``: :func:`check` passed on these very bytes
    (as a delta area checks every record first): one copying walk, every run still bounded inside
    ``dst``; bytes changed since the check may raise partway, some runs written."""
    r_addr, r_len, _r = _span(record, "record")
    d_addr, d_len, _d = _span(dst, "dst", writable=True)
    _raise(*_native.delta_apply(r_addr, r_len, d_addr, d_len, checked))


def header(record: Any) -> RecordHeader:
    """The header fields of a record (unchecked); InvalidWrite when shorter than a header."""
    addr, n, _r = _span(record, "record")
    if n < HEADER_BYTES:
        raise InvalidWrite(f"delta record: {n} bytes, shorter than the {HEADER_BYTES}-byte header")
    return RecordHeader(*HEADER.unpack(ctypes.string_at(addr, HEADER_BYTES)))
