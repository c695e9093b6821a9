// Change detection for GPU delta records (python/p2pweights/deltas/index_records.py): the bytes a
// sender is about to write (a slot) against the bytes it last committed (the base), in three passes
// over one record (the parameters of one unit size one rank loaded into one slot):
//   p2pw_delta_count   reads slot and base once, 8-byte words: one mask bit per changed word and,
//                      per group of 256 words, how many unit-sized elements changed;
//   (the host: an inclusive scan of the group counts, torch.cumsum, and the total, read with every other record of the slot in one copy)
//   p2pw_delta_gather  per changed word, its changed elements' positions (int32, ascending) and values
//                      at the group's offset, and the word copied into the base.
// Only the count pass touches every byte; at 1% changed the gather reads a mask of 1/64 of the slot
// and the changed words. p2pw_payload_checksum is the record payload's position-weighted sum, the
// same value as index_records.checksum's torch expression (both wrap modulo 2^64).
//
// Compiled by nvcc into a fatbin at build time where a CUDA toolkit is found, embedded in the native
// module and loaded through the driver API (csrc/buffers/copy_program.cpp: launch_embedded_kernel).
// Keep Span and the constants in step with index_records.py (KERNEL_* and _spans).
#include <cstdint>

namespace {

constexpr unsigned kWordsPerBlock = 4096;  // 32 KiB of slot per block
constexpr unsigned kCountThreads = 256;
constexpr unsigned kGroupWords = 256;  // the words one gather warp walks (one count iteration); counted apart
constexpr unsigned kGroupsPerBlock = kWordsPerBlock / kGroupWords;
constexpr unsigned kGatherThreads = 32 * kGroupsPerBlock;
constexpr unsigned long long kMult = 0x9E3779B97F4A7C15ull;

struct Span {                    // one parameter of the record; int64[5] on the host
  unsigned long long slot;       // address of its first byte in the slot
  unsigned long long base;       // address of its first byte in the base
  unsigned long long words;      // its 8-byte words
  unsigned long long word_start; // its first word in the record's concatenation
  unsigned long long first_block;
};

__device__ __forceinline__ int span_of(const Span* spans, int n, unsigned long long block) {
  int lo = 0, hi = n - 1;  // the last span starting at or before this block
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (spans[mid].first_block <= block) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The elements of `unit` bytes that differ in a word's xor: each lane's bits ORed into its lowest.
__device__ __forceinline__ unsigned changed_units(unsigned long long x, unsigned unit) {
  x |= x >> 1;
  x |= x >> 2;
  x |= x >> 4;
  if (unit == 1) return __popcll(x & 0x0101010101010101ull);
  x |= x >> 8;
  if (unit == 2) return __popcll(x & 0x0001000100010001ull);
  x |= x >> 16;
  return __popcll(x & 0x0000000100000001ull);
}

template <unsigned kThreads>
__device__ __forceinline__ unsigned long long block_sum(unsigned long long v, unsigned long long* shared) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = 0;
  if (threadIdx.x < 32) {
    v = threadIdx.x < kThreads / 32 ? shared[threadIdx.x] : 0;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
  }
  return v;  // thread 0's is the block's
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kCountThreads)
    p2pw_delta_count(const Span* spans, int n_spans, unsigned unit, unsigned* mask, long long* counts) {
  __shared__ unsigned long long partial[kCountThreads / 32][kGroupsPerBlock];
  const Span& s = spans[span_of(spans, n_spans, blockIdx.x)];
  const unsigned long long w0 = (blockIdx.x - s.first_block) * kWordsPerBlock;
  const unsigned long long left = s.words - w0;
  const unsigned n = left < kWordsPerBlock ? static_cast<unsigned>(left) : kWordsPerBlock;
  const unsigned long long* cur = reinterpret_cast<const unsigned long long*>(s.slot) + w0;
  const unsigned long long* old = reinterpret_cast<const unsigned long long*>(s.base) + w0;
  unsigned* bits = mask + static_cast<unsigned long long>(blockIdx.x) * (kWordsPerBlock / 32);
  unsigned count[kGroupsPerBlock] = {};
#pragma unroll
  for (unsigned it = 0; it < kWordsPerBlock / kCountThreads; ++it) {
    const unsigned i = it * kCountThreads + threadIdx.x;  // in group it: an iteration covers a group
    const unsigned long long x = i < n ? (__ldg(cur + i) ^ __ldg(old + i)) : 0ull;
    const unsigned b = __ballot_sync(0xffffffffu, x != 0);
    if (threadIdx.x % 32 == 0) bits[i / 32] = b;
    if (x) count[it * kCountThreads / kGroupWords] += changed_units(x, unit);
  }
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
#pragma unroll
  for (unsigned g = 0; g < kGroupsPerBlock; ++g) {
    unsigned v = count[g];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    if (lane == 0) partial[warp][g] = v;
  }
  __syncthreads();
  if (threadIdx.x < kGroupsPerBlock) {
    unsigned long long v = 0;
    for (unsigned w = 0; w < kCountThreads / 32; ++w) v += partial[w][threadIdx.x];
    counts[static_cast<unsigned long long>(blockIdx.x) * kGroupsPerBlock + threadIdx.x] = static_cast<long long>(v);
  }
}

// One warp per group of 256 words, 32 words at a time (one mask word: skipped whole when 0): each
// lane takes one word, and a warp scan of the lanes' changes places their outputs side by side, so
// loads and stores stay coalesced at any density and the positions come out ascending.
extern "C" __global__ void __launch_bounds__(kGatherThreads)
    p2pw_delta_gather(const Span* spans, int n_spans, unsigned unit, const unsigned* mask, const long long* ends,
                      int* positions, unsigned char* values) {
  const Span& s = spans[span_of(spans, n_spans, blockIdx.x)];
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned long long group = static_cast<unsigned long long>(blockIdx.x) * kGroupsPerBlock + warp;
  unsigned long long at = group ? static_cast<unsigned long long>(ends[group - 1]) : 0ull;
  const unsigned long long w0 = (blockIdx.x - s.first_block) * kWordsPerBlock + warp * kGroupWords;
  const unsigned long long* cur = reinterpret_cast<const unsigned long long*>(s.slot) + w0;
  unsigned long long* old = reinterpret_cast<unsigned long long*>(s.base) + w0;
  const unsigned* bits = mask + static_cast<unsigned long long>(blockIdx.x) * (kWordsPerBlock / 32) +
                         warp * (kGroupWords / 32);
  const unsigned lane_bits = lane < kGroupWords / 32 ? bits[lane] : 0u;  // the group's mask, one load
  const unsigned per = 8 / unit;
  const unsigned long long lane_mask = unit == 4 ? 0xffffffffull : (1ull << (8 * unit)) - 1;
  const unsigned long long first = (s.word_start + w0) * per;
  // every changed word of the group loaded first (up to 2 x 8 loads in flight per lane: at a few
  // percent changed the gather is bound by load latency, not bandwidth), then placed 32 at a time
  constexpr unsigned kRuns = kGroupWords / 32;
  unsigned long long c[kRuns], x[kRuns];
#pragma unroll
  for (unsigned j = 0; j < kRuns; ++j) {
    const bool mine = (__shfl_sync(0xffffffffu, lane_bits, j) >> lane) & 1u;
    c[j] = mine ? cur[j * 32 + lane] : 0ull;
    x[j] = mine ? old[j * 32 + lane] : 0ull;
  }
#pragma unroll
  for (unsigned j = 0; j < kRuns; ++j) {
    if (!__shfl_sync(0xffffffffu, lane_bits, j)) continue;  // the same for every lane
    const unsigned k = j * 32 + lane;
    x[j] ^= c[j];
    const unsigned n = x[j] ? changed_units(x[j], unit) : 0u;
    unsigned incl = n;
    for (int o = 1; o < 32; o <<= 1) {
      const unsigned up = __shfl_up_sync(0xffffffffu, incl, o);
      if (lane >= static_cast<unsigned>(o)) incl += up;
    }
    unsigned long long p = at + incl - n;
    at += __shfl_sync(0xffffffffu, incl, 31);
    if (!n) continue;
    for (unsigned e = 0; e < per; ++e) {
      const unsigned shift = e * 8 * unit;
      if (!((x[j] >> shift) & lane_mask)) continue;
      positions[p] = static_cast<int>(first + static_cast<unsigned long long>(k) * per + e);
      const unsigned long long v = (c[j] >> shift) & lane_mask;
      if (unit == 2) reinterpret_cast<unsigned short*>(values)[p] = static_cast<unsigned short>(v);
      else if (unit == 4) reinterpret_cast<unsigned*>(values)[p] = static_cast<unsigned>(v);
      else values[p] = static_cast<unsigned char>(v);
      ++p;
    }
    old[k] = c[j];  // the whole word: its other elements are equal
  }
}

extern "C" __global__ void __launch_bounds__(256)
    p2pw_payload_checksum(const unsigned long long* words, unsigned long long n, unsigned long long* out) {
  __shared__ unsigned long long partial[8];
  unsigned long long acc = 0;
  for (unsigned long long i = blockIdx.x * 256ull + threadIdx.x; i < n; i += gridDim.x * 256ull)
    acc += words[i] * ((2 * i + 1) * kMult);
  acc = block_sum<256>(acc, partial);
  if (threadIdx.x == 0) atomicAdd(out, acc);
}
