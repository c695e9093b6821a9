// Copy programs: a parameter group's recorded copy plan, compiled in Python into 2-D byte copies,
// executed here without Python in the loop (python/p2pweights/copyplans/ builds the descriptors).
//
// A program is an array of descriptors of kCopyColumns int64 each:
//   input      index into the inputs, or -1 for a zero fill
//   dst        byte offset from the group's first byte in the slot
//   src        byte offset from the input's first byte (ignored for a zero fill)
//   row_bytes  bytes per row (>= 1)
//   rows       rows (>= 1)
//   dst_pitch  bytes from one row's start to the next in the slot (>= row_bytes when rows > 1)
//   src_pitch  the same in the input (any sign: a source may be read backwards or repeated)
// A program may come from a file on disk: every descriptor is checked against the slot bytes and
// each input's bytes on every call, before any byte is written (check_program); that no two
// descriptors write the same byte is checked once, where a program is loaded (check_copy_program).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "status.h"

namespace p2pw {

constexpr int kCopyColumns = 7;

struct CopyInput {
  uint64_t address = 0;
  uint64_t nbytes = 0;
};

// The descriptors alone: each inside the slot's bytes and its input's bytes (input_nbytes[input]).
// Ok, or kOutOfRegion / kInvalidArgument naming the first bad descriptor.
Status check_descriptors(const int64_t* program, size_t count, uint64_t slot_bytes, const uint64_t* input_nbytes,
                         size_t num_inputs);
// What the run functions check on every call: every input has an address, then check_descriptors.
Status check_program(const int64_t* program, size_t count, uint64_t slot_bytes, const std::vector<CopyInput>& inputs);
// No byte of the slot is written by two descriptors (the batched kernel runs copies side by side:
// overlapping writes race). Descriptors must have passed check_descriptors. Sorts the destination
// bounding boxes and compares rows only where boxes overlap. kOutOfRegion naming both descriptors.
Status check_disjoint_writes(const int64_t* program, size_t count);
// check_descriptors, then check_disjoint_writes: what a program loaded from disk must pass once.
Status check_copy_program(const int64_t* program, size_t count, uint64_t slot_bytes,
                          const std::vector<uint64_t>& input_nbytes);

// Host memory on both sides: memcpy/memset, split by bytes across up to `threads` threads (the
// caller's included; the others are a pool started on first use and grown to the largest count
// asked, up to kMaxCopyThreads); a program of under kInlineCopyBytes runs on the calling thread.
constexpr uint64_t kInlineCopyBytes = 4ull << 20;
constexpr int kMaxCopyThreads = 64;
Status run_host_program(const int64_t* program, size_t count, uint64_t slot, uint64_t slot_bytes,
                        const std::vector<CopyInput>& inputs, int threads);

// The CUDA driver (libcuda.so.1), dlopen'ed: found once per process.
struct CudaDriverInfo {
  bool loaded = false;
  bool lanes = false;   // streams and events found: copies can be spread over side streams
  bool kernel = false;  // the batched copy kernel is embedded and the module/launch calls were found
  std::string library;
  std::string error;  // why not loaded
};
CudaDriverInfo cuda_driver_info();

// kKernel: the batched copy kernel (csrc/kernels/copy_batch.cu), one launch per 64 copies, where the
// module was built with it (CudaDriverInfo::kernel); else as kEach. kEach: one driver call per copy.
// (cuMemcpyBatchAsync was measured equal to kEach on the H200, benchmarks/RESULTS.md, and dropped.)
enum class CopyMode { kEach, kKernel };

// Device memory (or memory the device addresses through UVA): every copy enqueued on `stream`
// (a CUstream handle; 0 is the legacy default stream), nothing waited for. kEach: 1-D copies one
// cuMemcpyAsync each, 2-D copies cuMemcpy2DAsync, zero fills cuMemsetD8Async / cuMemsetD2D8Async.
// `calls` counts the driver calls made. kNotFound when there is no driver, kDeviceError when a
// driver call fails (nothing after it is enqueued; what was enqueued before still runs).
//
// lanes > 1 (kEach only; the kernel is one launch per 64 copies on `stream`): the copies are spread
// over that many side streams of the slot's context (made once, non-blocking), balanced by bytes:
// they wait for `stream`'s work so far, and `stream` waits for them before anything enqueued after
// the call (an event each way). A GPU runs consecutive small copies of one stream one after
// another with a few microseconds between them; side by side they overlap. The enqueue holds a
// per-context lock (the lanes' events are reused).
constexpr int kMaxCopyLanes = 16;
Status run_device_program(const int64_t* program, size_t count, uint64_t slot, uint64_t slot_bytes,
                          const std::vector<CopyInput>& inputs, uint64_t stream, CopyMode mode, int64_t* calls,
                          int lanes = 1);

// A kernel of an embedded fatbin (csrc/kernels/*.cu; `image` as cmake/embed_binary.cmake writes it),
// loaded once per context and launched with `args` on `stream` in the context that owns `anchor`
// (device memory the kernel touches). kNotFound without a driver; kDeviceError when loading or the
// launch fails (nothing enqueued).
Status launch_embedded_kernel(const void* image, const char* name, uint64_t anchor, unsigned grid, unsigned block,
                              void** args, uint64_t stream);

}  // namespace p2pw
