"""The native check of a copy program loaded from disk (``_native.check_copy_program``): the bounds the
run functions check, and that no two descriptors write the same destination byte (the batched copy
kernel runs copies side by side: overlapping writes would race). Descriptor columns: input, dst,
src, row_bytes, rows, dst_pitch, src_pitch (csrc/buffers/copy_program.h).
"""
from __future__ import annotations

import random
import time

import numpy as np
import pytest

from p2pweights import _native
from p2pweights.errors import code_of

OK, OUT_OF_REGION, INVALID = code_of("OK"), code_of("OUT_OF_REGION"), code_of("INVALID_ARGUMENT")
SRC = 1 << 20  # one input, large enough for every source read below


def check(rows, dst_bytes=1 << 16, inputs=(SRC,)):
    return _native.check_copy_program(np.array(rows, dtype=np.int64).reshape(-1, 7), dst_bytes, list(inputs))


def brute_force_overlap(rows) -> bool:
    seen = set()
    for _, dst, _, rb, n, dp, _ in rows:
        for r in range(n):
            cells = set(range(dst + r * dp, dst + r * dp + rb))
            if cells & seen:
                return True
            seen |= cells
    return False


def test_two_descriptors_writing_overlapping_bytes_are_refused_by_index():
    code, message = check([[0, 0, 0, 64, 1, 64, 64],
                           [-1, 512, 0, 8, 1, 8, 0],
                           [0, 60, 100, 16, 1, 16, 16]])  # bytes 60..63 written twice
    assert code == OUT_OF_REGION and "copy descriptors 0 and 2" in message, message


def test_adjacent_descriptors_are_accepted():
    assert check([[0, 0, 0, 64, 1, 64, 64], [0, 64, 0, 64, 1, 64, 64], [-1, 128, 0, 3, 1, 3, 0]]) == (OK, "")


def test_interleaved_rows_of_two_2d_descriptors_that_do_not_overlap_are_accepted():
    # two column shards of a 16-byte-wide matrix: columns 0..7 and 8..15 of 100 rows; and a third
    # 2-D copy whose rows wrap across line boundaries of another pitch-16 copy without touching it
    rows = [[0, 0, 0, 8, 100, 16, 8], [0, 8, 800, 8, 100, 16, 8]]
    assert check(rows) == (OK, "")
    wrapped = [[0, 4000 + 12, 0, 8, 50, 16, 8], [0, 4000 + 4, 0, 8, 50, 16, 8]]  # cols 12..19 and 4..11
    assert check(wrapped) == (OK, "")
    # different pitches interleaved: rows of 4 every 8 bytes, and single bytes in the gaps
    mixed = [[0, 0, 0, 4, 64, 8, 4]] + [[0, 8 * k + 4, 0, 4, 1, 4, 4] for k in range(64)]
    mixed.append([0, 4, 0, 2, 10, 24, 2])  # another pitch, inside gaps that descriptors 1.. also fill
    code, message = check(mixed)
    assert code == OUT_OF_REGION and "descriptors 1 and 65" in message, message
    assert check(mixed[:-1]) == (OK, "")


def test_interleaved_rows_that_do_overlap_are_refused():
    code, message = check([[0, 0, 0, 8, 100, 16, 8], [0, 1600 - 16 * 30 + 7, 0, 8, 10, 16, 8]])
    assert code == OUT_OF_REGION and "copy descriptors 0 and 1" in message, message
    # rows wrapping into the next line (columns 12..15 then 0..3) meet rows at columns 2..9
    code, message = check([[0, 4000 + 12, 0, 8, 50, 16, 8], [0, 4000 + 2, 0, 8, 50, 16, 8]])
    assert code == OUT_OF_REGION and "copy descriptors 0 and 1" in message, message
    # the one overlapping byte is the last row of one and the first of the other, different pitches
    code, message = check([[0, 0, 0, 4, 10, 8, 4], [0, 75, 0, 2, 3, 100, 2]])
    assert code == OUT_OF_REGION and "copy descriptors 0 and 1" in message, message


def test_a_descriptor_whose_own_rows_overlap_is_refused():
    code, message = check([[0, 0, 0, 8, 2, 4, 8]])
    assert code != OK and "copy descriptor 0" in message and "rows must not overlap" in message, message


def test_bounds_are_checked_first_against_the_destination_and_each_input():
    code, message = check([[0, 0, 0, 64, 1, 64, 64]], dst_bytes=63)
    assert code == OUT_OF_REGION and "writes up to byte 64" in message
    code, message = check([[0, 0, 10, 64, 1, 64, 64]], inputs=(70,))
    assert code == OUT_OF_REGION and "reads bytes [10, 74) of input 0" in message
    code, message = check([[1, 0, 0, 8, 1, 8, 8]])
    assert code == INVALID and "names input 1 of 1" in message


@pytest.mark.parametrize("seed", range(6))
def test_random_programs_agree_with_a_byte_by_byte_check(seed):
    rng = random.Random(seed)
    for _ in range(60):
        rows = []
        for _ in range(rng.randint(2, 7)):
            rb, n = rng.randint(1, 6), rng.choice([1, 1, 2, 5])
            dp = rng.choice([rb, rb + 1, 8, 13]) if n > 1 else rb
            dp = max(dp, rb)
            rows.append([rng.choice([0, -1]), rng.randint(0, 80), 0, rb, n, dp, rb])
        code, message = check(rows, dst_bytes=1 << 10)
        assert (code == OUT_OF_REGION) == brute_force_overlap(rows), (rows, message)
        assert code in (OK, OUT_OF_REGION), message


def test_a_program_of_100k_descriptors_checks_ok_and_names_the_one_overlapping_pair():
    # 1-D copies end to end, and a column-sharded block: 50k 2-D copies of 64 rows interleaved by pitch
    n1, n2 = 50_000, 50_000
    flat = np.zeros((n1, 7), dtype=np.int64)
    flat[:, 1] = np.arange(n1) * 32
    flat[:, 3:6] = (32, 1, 32)
    base = n1 * 32
    cols = np.zeros((n2, 7), dtype=np.int64)
    cols[:, 1] = base + np.arange(n2) * 2  # 50k columns of 2 bytes, rows 100 KB apart
    cols[:, 3:7] = (2, 64, n2 * 2, 2)
    program = np.concatenate([flat, cols])
    dst_bytes = base + 64 * n2 * 2
    assert _native.check_copy_program(program, dst_bytes, [SRC]) == (OK, "")
    program[-1, 1] -= 1  # the last column now shares a byte with its neighbour in every row
    code, message = _native.check_copy_program(program, dst_bytes, [SRC])
    assert code == OUT_OF_REGION and f"descriptors {n1 + n2 - 2} and {n1 + n2 - 1}" in message, message


def test_host_programs_reuse_one_pool_of_threads_and_concurrent_calls_each_write_their_bytes():
    import os
    import threading

    def tasks() -> int:  # the process's threads (numpy alone below: torch starts threads of its own)
        return len(os.listdir("/proc/self/task"))

    n = 16 << 20  # past kInlineCopyBytes: split over threads
    src = np.random.default_rng(0).integers(0, 255, n, dtype=np.uint8)
    program = np.array([[0, 0, 0, n // 2, 1, n // 2, n // 2], [0, n // 2, n // 2, 1024, n // 2048, 1024, 1024]],
                       dtype=np.int64)

    def run(threads: int) -> bool:
        slot = np.zeros(n, dtype=np.uint8)
        code, message = _native.run_copy_program_host(program, slot.ctypes.data, n, [src.ctypes.data], [n], threads)
        return code == OK and bool(np.array_equal(slot, src))

    assert run(6)
    before = tasks()
    assert all(run(k) for k in (2, 6, 3, 6) * 5)  # no larger count than the first: no new thread
    assert tasks() == before
    results = []
    callers = [threading.Thread(target=lambda k=k: results.append(run(k))) for k in (2, 4, 6, 8)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert results == [True] * 4
    for _ in range(100):  # a joined Python thread may take a moment to leave /proc
        if tasks() <= before + 2:
            break
        time.sleep(0.02)
    assert tasks() == before + 2  # grown once, to the largest count asked (8: a caller and 7 helpers)
