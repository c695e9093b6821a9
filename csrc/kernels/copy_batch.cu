// One launch copies a batch of a slot's 2-D byte copies (csrc/buffers/copy_program.h): compiled by
// nvcc into a fatbin at build time where a CUDA toolkit is found, embedded in the native module and
// loaded through the driver API (cuModuleLoadData); no CUDA runtime is linked. Each copy is cut into
// chunks of kChunkBytes; block b copies chunk b of the batch, in the widest unit (16, 8, 4, 2 or 1
// bytes) that divides the copy's addresses, row bytes and pitches (the host computes it).
//
// The batch travels as the kernel's parameter (__grid_constant__: read in place, not copied per
// thread), so nothing is allocated or uploaded per launch. Keep the layout in step with
// copy_program.cpp's KernelBatch.
#include <cstdint>

namespace {

constexpr unsigned long long kChunkBytes = 64 << 10;
constexpr int kMaxEntries = 64;

struct Entry {
  unsigned long long dst;    // address of the first row
  unsigned long long src;    // address of the first row; 0: a zero fill
  long long dst_pitch;       // bytes between rows
  long long src_pitch;
  unsigned long long units_per_row;
  unsigned long long units;  // units_per_row * rows
  unsigned int first_chunk;  // this entry's first block
  unsigned int width;        // unit bytes: 16, 8, 4, 2 or 1
};

struct Batch {
  unsigned int count;
  unsigned int pad;
  Entry entries[kMaxEntries];
};

template <typename T>
__device__ __forceinline__ void copy_units(const Entry& e, unsigned long long u0, unsigned long long u1) {
  if (e.units_per_row == e.units) {  // one row: no division
    T* d = reinterpret_cast<T*>(e.dst);
    const T* s = reinterpret_cast<const T*>(e.src);
    for (unsigned long long u = u0 + threadIdx.x; u < u1; u += blockDim.x) d[u] = e.src ? s[u] : T{};
    return;
  }
  for (unsigned long long u = u0 + threadIdx.x; u < u1; u += blockDim.x) {
    const unsigned long long row = u / e.units_per_row;
    const unsigned long long col = u - row * e.units_per_row;
    T* d = reinterpret_cast<T*>(e.dst + row * e.dst_pitch) + col;
    *d = e.src ? *(reinterpret_cast<const T*>(e.src + row * e.src_pitch) + col) : T{};
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(256) p2pw_copy_batch(const __grid_constant__ Batch batch) {
  const unsigned int chunk = blockIdx.x;
  int lo = 0, hi = static_cast<int>(batch.count) - 1;  // the last entry starting at or before this chunk
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.entries[mid].first_chunk <= chunk) lo = mid; else hi = mid - 1;
  }
  const Entry& e = batch.entries[lo];
  const unsigned long long per = kChunkBytes / e.width;
  const unsigned long long u0 = static_cast<unsigned long long>(chunk - e.first_chunk) * per;
  if (u0 >= e.units) return;
  const unsigned long long u1 = u0 + per < e.units ? u0 + per : e.units;
  switch (e.width) {
    case 16: copy_units<uint4>(e, u0, u1); break;
    case 8: copy_units<unsigned long long>(e, u0, u1); break;
    case 4: copy_units<unsigned int>(e, u0, u1); break;
    case 2: copy_units<unsigned short>(e, u0, u1); break;
    default: copy_units<unsigned char>(e, u0, u1); break;
  }
}
