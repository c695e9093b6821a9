"""The planner's expected delta size (p2pweights.deltas.expected) against the native codec: random
slots whose units changed independently with probability F, at F in {0, 0.001, 0.01, 0.03, 0.1,
0.3, 1.0}, units of 2 (BF16) and 1 (FP8).

Tolerance: 5% relative on the encoded bytes and on the run count of a 16 MiB slot (the sampling
noise is about 1% at F = 0.001, the sparsest: 8,000 runs), exact at F = 0 (EMPTY: the header) and
F = 1 (DENSE: header + slot). A model without the codec's merge rule misses the run count by 11% or
more at F >= 0.1 (unit 1's bytes by 10% at F = 0.3), which the last test checks this tolerance sees.
Seeds are fixed and printed in every failure.
"""
from __future__ import annotations

import numpy as np
import pytest

from p2pweights import deltas
from p2pweights.deltas.codec import HEADER_BYTES
from p2pweights.deltas.expected import expected_ratio, expected_record

FRACTIONS = (0.0, 0.001, 0.01, 0.03, 0.1, 0.3, 1.0)
SLOT = 16 << 20
REL = 0.05


def changed_slot(fraction: float, unit: int, nbytes: int, seed: int, *, whole_units: bool = False):
    """(cur, base): each unit of base changed in cur with probability ``fraction``; a changed unit
    differs in its low byte, or (half of them, or all with ``whole_units``) in every byte it has,
    as a BF16 element moved by one ulp or by more."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, nbytes, dtype=np.uint8)
    units = -(-nbytes // unit)
    changed = np.flatnonzero(rng.random(units) < fraction)
    flip = np.zeros(units * unit, dtype=np.uint8)
    flip[changed * unit] = rng.integers(1, 256, changed.size, dtype=np.uint8)
    wide = changed if whole_units else changed[rng.random(changed.size) < 0.5]
    for b in range(1, unit):
        flip[wide * unit + b] = rng.integers(1, 256, wide.size, dtype=np.uint8)
    return base ^ flip[:nbytes], base


def close(predicted: float, measured: float) -> bool:
    return abs(predicted - measured) <= REL * measured


@pytest.mark.parametrize("unit", [2, 1])
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_prediction_matches_the_native_codec_on_random_slots(unit, fraction):
    seed = 1000 * unit + FRACTIONS.index(fraction)
    cur, base = changed_slot(fraction, unit, SLOT, seed)
    got = deltas.encode(cur, base, unit).stats
    want = expected_record(fraction, unit, SLOT)
    where = f"unit {unit}, F {fraction}, seed {seed}: measured {got}, predicted {want}"
    assert want.mode == got.mode, where
    if fraction in (0.0, 1.0):
        assert want.encoded_bytes == got.encoded_bytes == (HEADER_BYTES if fraction == 0 else HEADER_BYTES + SLOT), where
        assert want.runs == got.runs, where
    else:
        assert close(want.encoded_bytes, got.encoded_bytes), where
        assert close(want.runs, got.runs), where
    assert expected_ratio(fraction, unit, SLOT) == want.ratio


@pytest.mark.parametrize("unit,nbytes", [(2, 4097), (4, 1001), (1, 3000)])
@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.3])
def test_small_slots_and_a_short_last_unit_average_to_the_prediction(unit, nbytes, fraction):
    """Where the header, the slot's edges and the short last unit weigh: the mean over many slots."""
    trials = 1500
    sizes = []
    for i in range(trials):
        cur, base = changed_slot(fraction, unit, nbytes, seed=10_000 + i)
        sizes.append(deltas.encode(cur, base, unit).stats.encoded_bytes)
    want = expected_record(fraction, unit, nbytes).encoded_bytes
    assert abs(want - np.mean(sizes)) <= 0.02 * np.mean(sizes), (unit, nbytes, fraction, want, np.mean(sizes))


def test_a_bf16_element_whose_low_byte_alone_moved_costs_both_bytes():
    """Runs are unit-granular: one byte or two changed in a unit, the record is the same size."""
    low, base = changed_slot(0.01, 2, 1 << 20, seed=3)
    whole, _ = changed_slot(0.01, 2, 1 << 20, seed=3, whole_units=True)
    a, b = deltas.encode(low, base, 2).stats, deltas.encode(whole, base, 2).stats
    assert a.encoded_bytes == b.encoded_bytes and a.runs == b.runs
    assert b.changed_bytes == a.changed_bytes  # changed bytes count whole units too


@pytest.mark.parametrize("unit,fraction", [(2, 0.1), (2, 0.3), (1, 0.1), (1, 0.3)])
def test_the_tolerance_tells_a_codec_without_the_merge_rule_apart(unit, fraction):
    cur, base = changed_slot(fraction, unit, SLOT, seed=1000 * unit + FRACTIONS.index(fraction))
    got = deltas.encode(cur, base, unit).stats
    unmerged = expected_record(fraction, unit, SLOT, merge_bytes=0)
    assert not close(unmerged.runs, got.runs)


def test_bad_arguments_are_refused():
    for bad in (dict(fraction=-0.1), dict(fraction=1.5), dict(fraction=0.1, unit=3), dict(fraction=0.1, nbytes=0)):
        with pytest.raises(ValueError):
            expected_record(**bad)
