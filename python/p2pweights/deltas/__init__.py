"""Delta updates (issue 24): after the first update, only the bytes that changed cross the wire.

- codec (codec.py): one slot's delta record: :func:`encode` on the sender (``cur`` against the
  committed ``base``), :func:`check` and :func:`apply` on the engine rank; the byte layout is in
  csrc/buffers/delta_codec.h.
"""
from __future__ import annotations

from .codec import DeltaRecord, DeltaStats, RecordHeader, apply, check, encode, header, max_encoded

__all__ = ["DeltaRecord", "DeltaStats", "RecordHeader", "apply", "check", "encode", "header", "max_encoded"]
