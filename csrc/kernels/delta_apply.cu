// The engine side of GPU delta records (python/p2pweights/deltas/index_apply.py): every index record
// of a delta area checked, then applied, each in one launch for the whole area.
//   p2pw_records_check  per record: the payload's checksum (index_records.checksum's value) and the
//                       number of positions that are not strictly ascending inside [0, total);
//                       both added into the record's verdict, read by the host once for all records
//   p2pw_records_apply  per changed element: its table row (a binary search of the record's rows),
//                       and its value stored at the row's destination
// The host parses and checks every header and table first (deltas/area.py); these kernels get only
// what it checked (Record, Row). The area's bytes may still change under them (a late writer), so
// the apply re-checks each position against its record's bounds: a position it did not check is
// skipped, never stored outside the rows the host checked.
//
// Compiled by nvcc into a fatbin at build time, embedded and loaded through the driver API
// (csrc/buffers/copy_program.cpp: launch_embedded_kernel). Keep Record, Row and the constants in
// step with csrc/buffers/delta_apply_gpu.h and deltas/kernels.py.
#include <cstdint>

namespace {

constexpr unsigned kThreads = 256;
constexpr unsigned kCheckWords = 4096;    // payload words one check block covers (16 per thread)
constexpr unsigned kApplyElements = 2048; // changed elements one apply block covers (8 per thread)
constexpr unsigned long long kMult = 0x9E3779B97F4A7C15ull;

struct Record {                     // int64[8] on the host
  unsigned long long payload;       // device address: count int32 positions, then values at pad8(4 * count)
  unsigned long long count;         // changed elements
  unsigned long long unit;          // 1, 2, 4 or 8 bytes
  unsigned long long total;         // elements of its table (positions lie in [0, total))
  unsigned long long check_block;   // its first block of the check grid
  unsigned long long apply_block;   // its first block of the apply grid
  unsigned long long first_row;     // its rows in the row array
  unsigned long long rows;
};

struct Row {                        // int64[3]: the table row as the host checked it
  unsigned long long position;      // its first element in the record's concatenation
  unsigned long long elements;
  unsigned long long dest;          // device address of its first byte
};

// The record whose blocks (first block in `field`) hold `block`: the last starting at or before it.
template <unsigned long long Record::*field>
__device__ __forceinline__ int record_of(const Record* records, int n, unsigned long long block) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (records[mid].*field <= block) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__device__ __forceinline__ unsigned long long pad8(unsigned long long n) { return (n + 7) & ~7ull; }

}  // namespace

// verdicts: n_records x {checksum, faults} (uint64, zeroed by the caller).
extern "C" __global__ void __launch_bounds__(kThreads)
    p2pw_records_check(const Record* records, int n_records, unsigned long long* verdicts) {
  __shared__ unsigned long long partial[kThreads / 32];
  const int r = record_of<&Record::check_block>(records, n_records, blockIdx.x);
  const Record rec = records[r];
  const unsigned long long words = (pad8(4 * rec.count) + pad8(rec.unit * rec.count)) / 8;
  const unsigned long long w0 = (blockIdx.x - rec.check_block) * kCheckWords;
  const unsigned long long* payload = reinterpret_cast<const unsigned long long*>(rec.payload);
  const int* positions = reinterpret_cast<const int*>(rec.payload);
  unsigned long long acc = 0;
  bool fault = false;
  for (unsigned k = threadIdx.x; k < kCheckWords; k += kThreads) {
    const unsigned long long i = w0 + k;
    if (i >= words) break;
    acc += payload[i] * ((2 * i + 1) * kMult);  // wraps modulo 2^64, as the torch expression does
    for (unsigned long long j = 2 * i; j < 2 * i + 2 && j < rec.count; ++j) {  // the word's positions
      const long long p = positions[j];
      fault |= p < 0 || static_cast<unsigned long long>(p) >= rec.total;
      if (j + 1 < rec.count) fault |= positions[j + 1] <= p;
    }
  }
  const bool any = __syncthreads_or(fault);
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long sum = 0;
    for (unsigned w = 0; w < kThreads / 32; ++w) sum += partial[w];
    atomicAdd(verdicts + 2 * r, sum);
    if (any) atomicAdd(verdicts + 2 * r + 1, 1ull);
  }
}

extern "C" __global__ void __launch_bounds__(kThreads)
    p2pw_records_apply(const Record* records, int n_records, const Row* rows) {
  const int r = record_of<&Record::apply_block>(records, n_records, blockIdx.x);
  const Record rec = records[r];
  const int* positions = reinterpret_cast<const int*>(rec.payload);
  const unsigned char* values = reinterpret_cast<const unsigned char*>(rec.payload) + pad8(4 * rec.count);
  const Row* mine = rows + rec.first_row;
  if (rec.rows == 0) return;  // the host gives every record a row; never search an empty table
  const unsigned long long j0 = (blockIdx.x - rec.apply_block) * kApplyElements;
  for (unsigned k = threadIdx.x; k < kApplyElements; k += kThreads) {
    const unsigned long long j = j0 + k;
    if (j >= rec.count) break;
    const long long p = positions[j];
    if (p < 0 || static_cast<unsigned long long>(p) >= rec.total) continue;  // checked; changed since: skipped
    const unsigned long long at = static_cast<unsigned long long>(p);
    unsigned long long lo = 0, hi = rec.rows - 1;  // the last row starting at or before it
    while (lo < hi) {
      const unsigned long long mid = (lo + hi + 1) / 2;
      if (mine[mid].position <= at) lo = mid; else hi = mid - 1;
    }
    const Row row = mine[lo];
    const unsigned long long off = at - row.position;
    if (at < row.position || off >= row.elements) continue;
    const unsigned long long dst = row.dest + off * rec.unit;
    switch (rec.unit) {
      case 1: *reinterpret_cast<unsigned char*>(dst) = values[j]; break;
      case 2: *reinterpret_cast<unsigned short*>(dst) = reinterpret_cast<const unsigned short*>(values)[j]; break;
      case 4: *reinterpret_cast<unsigned*>(dst) = reinterpret_cast<const unsigned*>(values)[j]; break;
      default: *reinterpret_cast<unsigned long long*>(dst) = reinterpret_cast<const unsigned long long*>(values)[j];
    }
  }
}
