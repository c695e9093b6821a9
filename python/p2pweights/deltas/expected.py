"""The expected size of a delta record, derived from the codec's rules (csrc/buffers/delta_codec.h),
for a slot whose units changed independently with probability ``fraction`` -- uniformly spread, as
an RL step's small updates are. The planner scales an update's bytes by it (planner/delta_cost.py).

What the codec does, and so what is modelled (n units of ``unit`` bytes, the last maybe short;
p = fraction, q = 1 - p):

- It compares whole units and copies whole units: a BF16 element of which only the low byte moved
  still costs both bytes with unit 2. Runs are unit-granular, so "changed" below means "the unit
  differs in any byte".
- Runs of changed units are joined across a gap of at most m = 2 // unit unchanged units
  (kMergeBytes = 2 bytes); so a run starts at unit i when unit i changed and the m + 1 units before
  it did not (or the slot starts there): E[runs] = p * sum_i q^min(i, m + 1).
- The run's bytes: every changed unit, and every unchanged unit in a joined gap of k <= m units
  (p^2 q^k per position), less the short last unit's missing bytes when it is covered.
- Each run's two LEB128 varints: a varint takes one byte plus one per power of 128 it reaches. A run
  with a gap of at least t >= m + 1 units is a changed unit after t unchanged ones: (n - t) p q^t of
  them. A run reaches length t (units, joined gaps included) with the probability that its chain
  of changed units, each the next within m + 1 units, lands at offset t - 1 or beyond: a linear
  recurrence of order m + 1, evaluated by a matrix power.
- A 48-byte header; EMPTY when nothing changed (the header alone); DENSE (header + the slot's bytes)
  as soon as RUNS would not be smaller than the slot.

Every term is the exact expectation except the length varints of runs that the slot's end cuts
short (counted as if the slot went on) and the DENSE cap, applied to the expected payload:
E[min(payload, slot)] <= min(E[payload], slot), so near the RUNS/DENSE crossover (p close to 1 for
units of 1 and 2) in a small slot the prediction is an upper bound. tests/test_delta_expected.py
holds it to the native codec.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .codec import HEADER_BYTES, UNITS

MERGE_BYTES = 2  # kMergeBytes (delta_codec.h): a gap of at most this many bytes is written, not a new run
DEFAULT_SLOT_BYTES = 64 << 20  # a large parameter's bytes: the header is then negligible
_VARINT_STEPS = tuple(128 ** j for j in range(1, 10))  # a varint gains a byte at each (10 bytes at most)


@dataclass(frozen=True)
class ExpectedRecord:
    """The expected record of one slot: ``runs`` runs whose bytes (``run_bytes``) and varints
    (``varint_bytes``) make the RUNS payload; ``encoded_bytes`` is the record, header included,
    in ``mode`` (the mode the expected payload picks)."""

    slot_bytes: int
    unit: int
    fraction: float
    runs: float
    run_bytes: float
    varint_bytes: float
    encoded_bytes: float
    mode: str

    @property
    def payload_bytes(self) -> float:
        """The RUNS payload (what DENSE caps)."""
        return self.run_bytes + self.varint_bytes

    @property
    def ratio(self) -> float:
        """Encoded bytes over the slot's bytes."""
        return self.encoded_bytes / self.slot_bytes


def expected_ratio(fraction: float, unit: int = 2, nbytes: int = DEFAULT_SLOT_BYTES) -> float:
    """Expected encoded bytes / slot bytes of an ``nbytes`` slot whose ``unit``-byte units changed
    independently with probability ``fraction``."""
    return expected_record(fraction, unit, nbytes).ratio


def expected_record(fraction: float, unit: int = 2, nbytes: int = DEFAULT_SLOT_BYTES, *,
                    merge_bytes: int = MERGE_BYTES) -> ExpectedRecord:
    """The expected record (see the module). ``merge_bytes`` is the codec's constant; another
    value models another codec (the test uses 0 to show that it can tell the difference)."""
    p = float(fraction)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"changed fraction {fraction!r}: must lie in [0, 1]")
    if unit not in UNITS:
        raise ValueError(f"unit {unit!r}: the codec compares units of {', '.join(map(str, UNITS))} bytes")
    if nbytes < 1:
        raise ValueError(f"slot bytes {nbytes!r}: must be at least 1")
    q = 1.0 - p
    n = -(-nbytes // unit)  # units, the last maybe short
    short = n * unit - nbytes  # bytes the last unit lacks
    m = merge_bytes // unit  # unchanged units a join may cover

    def starts(k: int) -> float:
        """Expected runs starting among the first k units."""
        if k <= 0:
            return 0.0
        head = sum(q ** i for i in range(min(k, m + 1)))
        return p * (head + max(0, k - m - 1) * q ** (m + 1))

    runs = starts(n)
    covered = n * p + sum(k * p * p * q ** k * max(0, n - k - 1) for k in range(1, m + 1))
    run_bytes = covered * unit - p * short
    gap_varints = runs + sum((n - t) * p * q ** t for t in _VARINT_STEPS if t < n)
    length_varints = runs + sum(starts(n - t + 1) * _reach(p, m, t) for t in _VARINT_STEPS if t <= n)
    varint_bytes = gap_varints + length_varints
    payload = run_bytes + varint_bytes
    if p == 0.0:
        mode, encoded = "empty", float(HEADER_BYTES)
    elif payload >= nbytes:
        mode, encoded = "dense", float(HEADER_BYTES + nbytes)
    else:
        mode, encoded = "runs", HEADER_BYTES + payload
    return ExpectedRecord(nbytes, unit, p, runs, run_bytes, varint_bytes, encoded, mode)


def _reach(p: float, m: int, t: int) -> float:
    """P(a run is at least t units long): its chain of changed units (each the next changed unit
    within m + 1 units of the last) lands at offset t - 1 or beyond. a[d], the probability that the
    unit at offset d is changed and on the chain, follows a[d] = p * sum_k q^k a[d - 1 - k]
    (k = 0..m, a[0] = 1); the chain's first landing at or past t - 1 comes from some a[t - 2 - j]."""
    if t <= 1:
        return 1.0
    q = 1.0 - p
    step = np.zeros((m + 1, m + 1))
    step[0, :] = [p * q ** k for k in range(m + 1)]
    for i in range(1, m + 1):
        step[i, i - 1] = 1.0
    state = np.linalg.matrix_power(step, t - 2)[:, 0]  # (a[t-2], ..., a[t-2-m]) from a[0] = 1
    tails = [sum(q ** h for h in range(j, m + 1)) for j in range(m + 1)]
    return float(min(1.0, max(0.0, p * sum(state[j] * tails[j] for j in range(m + 1)))))

