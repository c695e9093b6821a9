// The engine side of GPU delta records (csrc/kernels/delta_apply.cu): an area's index records
// checked, then applied, one launch each for the whole area, on a caller's stream through the
// driver API. Python parses and checks every header and table first and hands over only what it
// checked (python/p2pweights/deltas/index_apply.py); every address is device memory of one context.
#pragma once

#include <cstdint>

#include "status.h"

namespace p2pw {

// Whether the module was built with these kernels (nvcc found at build time).
bool delta_apply_kernels_embedded();

// Payload words one check block covers and changed elements one apply block covers
// (delta_apply.cu's kCheckWords, kApplyElements): the host lays each record's blocks out with them.
constexpr uint64_t kDeltaCheckWords = 4096;
constexpr uint64_t kDeltaApplyElements = 2048;

// `records` = n_records x int64[8] (payload address, count, unit, total elements, first check block,
// first apply block, first row, rows), ascending in both first blocks; `verdicts` = n_records x
// {checksum, faults} uint64, zeroed by the caller; `blocks` = the check grid.
Status delta_records_check(uint64_t records, int n_records, uint64_t verdicts, uint64_t blocks, uint64_t stream);
// `rows` = int64[3] (position, elements, destination address) per table row, every record's in turn;
// `blocks` = the apply grid. Run only after the verdicts (and the host's digest) passed.
Status delta_records_apply(uint64_t records, int n_records, uint64_t rows, uint64_t blocks, uint64_t stream);

}  // namespace p2pw
