// The GPU delta kernels (csrc/kernels/delta_find.cu), launched through the driver API on a caller's
// stream; every address is device memory of one context. Python drives the passes
// (python/p2pweights/deltas/index_records.py) and owns the scratch (torch tensors).
#pragma once

#include <cstdint>

#include "status.h"

namespace p2pw {

// Whether the module was built with the kernels (nvcc found at build time).
bool delta_kernels_embedded();

// Slot bytes one count/gather block covers (delta_find.cu's kWordsPerBlock * 8), and the groups of
// 256 words it counts apart (kGroupsPerBlock).
constexpr uint64_t kDeltaBlockBytes = 4096 * 8;
constexpr uint64_t kDeltaGroupsPerBlock = 16;

// Pass 1 over `blocks` blocks: `spans` = n_spans x int64[5] (slot address, base address, words,
// first word in the record, first block), `mask` = blocks * 128 uint32, `counts` = blocks * kDeltaGroupsPerBlock int64.
Status delta_find_count(uint64_t spans, int n_spans, unsigned unit, uint64_t mask, uint64_t counts, unsigned blocks,
                        uint64_t stream);
// Pass 2: `ends` = the inclusive scan of `counts`; writes positions (int32) and values (unit bytes
// each) and moves the changed words of the bases on.
Status delta_find_gather(uint64_t spans, int n_spans, unsigned unit, uint64_t mask, uint64_t ends, uint64_t positions,
                         uint64_t values, unsigned blocks, uint64_t stream);
// The payload's checksum (index_records.checksum) added into *out (one int64, zeroed by the caller).
Status payload_checksum(uint64_t words, uint64_t n_words, uint64_t out, uint64_t stream);

}  // namespace p2pw
