#include "buffers/delta_apply_gpu.h"

#ifdef P2PW_HAVE_DELTA_APPLY_KERNEL
#include "delta_apply_fatbin.h"
#endif

#include <string>

#include "buffers/copy_program.h"

namespace p2pw {

namespace {

constexpr unsigned kThreads = 256;  // delta_apply.cu's kThreads
constexpr uint64_t kMaxGrid = 0x7fffffffu;

Status launch(const char* name, uint64_t anchor, uint64_t grid, void** args, uint64_t stream) {
  if (grid > kMaxGrid) return Status(Code::kInvalidArgument, std::string(name) + ": a grid of " + std::to_string(grid) + " blocks");
#ifdef P2PW_HAVE_DELTA_APPLY_KERNEL
  return launch_embedded_kernel(p2pw_delta_apply_fatbin, name, anchor, static_cast<unsigned>(grid), kThreads, args, stream);
#else
  (void)anchor, (void)grid, (void)args, (void)stream;
  return Status(Code::kNotFound, std::string(name) + ": the native module was built without nvcc");
#endif
}

}  // namespace

bool delta_apply_kernels_embedded() {
#ifdef P2PW_HAVE_DELTA_APPLY_KERNEL
  return true;
#else
  return false;
#endif
}

Status delta_records_check(uint64_t records, int n_records, uint64_t verdicts, uint64_t blocks, uint64_t stream) {
  if (blocks == 0) return Status::Ok();
  if (n_records < 1 || records == 0 || verdicts == 0)
    return Status(Code::kInvalidArgument, "delta records check: no records or verdicts");
  void* args[] = {&records, &n_records, &verdicts};
  return launch("p2pw_records_check", verdicts, blocks, args, stream);
}

Status delta_records_apply(uint64_t records, int n_records, uint64_t rows, uint64_t blocks, uint64_t stream) {
  if (blocks == 0) return Status::Ok();
  if (n_records < 1 || records == 0 || rows == 0)
    return Status(Code::kInvalidArgument, "delta records apply: no records or rows");
  void* args[] = {&records, &n_records, &rows};
  return launch("p2pw_records_apply", rows, blocks, args, stream);
}

}  // namespace p2pw
