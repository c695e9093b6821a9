#include "buffers/delta_find.h"

#ifdef P2PW_HAVE_DELTA_KERNEL
#include "delta_find_fatbin.h"
#endif

#include <string>

#include "buffers/copy_program.h"

namespace p2pw {

namespace {

constexpr unsigned kCountThreads = 256;   // delta_find.cu's kCountThreads
constexpr unsigned kGatherThreads = 512;  // one warp per group: 32 * kGroupsPerBlock
constexpr unsigned kChecksumBlocks = 1024;

Status launch(const char* name, uint64_t anchor, unsigned grid, unsigned block, void** args, uint64_t stream) {
#ifdef P2PW_HAVE_DELTA_KERNEL
  return launch_embedded_kernel(p2pw_delta_find_fatbin, name, anchor, grid, block, args, stream);
#else
  (void)anchor, (void)grid, (void)block, (void)args, (void)stream;
  return Status(Code::kNotFound, std::string(name) + ": the native module was built without nvcc");
#endif
}

Status check_unit(unsigned unit) {
  if (unit == 1 || unit == 2 || unit == 4) return Status::Ok();
  return Status(Code::kInvalidArgument, "a delta kernel's unit is 1, 2 or 4 bytes, not " + std::to_string(unit));
}

}  // namespace

bool delta_kernels_embedded() {
#ifdef P2PW_HAVE_DELTA_KERNEL
  return true;
#else
  return false;
#endif
}

Status delta_find_count(uint64_t spans, int n_spans, unsigned unit, uint64_t mask, uint64_t counts, unsigned blocks,
                        uint64_t stream) {
  Status s = check_unit(unit);
  if (!s.ok() || blocks == 0) return s;
  if (n_spans < 1 || spans == 0 || mask == 0 || counts == 0) return Status(Code::kInvalidArgument, "delta count: no spans or scratch");
  void* args[] = {&spans, &n_spans, &unit, &mask, &counts};
  return launch("p2pw_delta_count", spans, blocks, kCountThreads, args, stream);
}

Status delta_find_gather(uint64_t spans, int n_spans, unsigned unit, uint64_t mask, uint64_t ends, uint64_t positions,
                         uint64_t values, unsigned blocks, uint64_t stream) {
  Status s = check_unit(unit);
  if (!s.ok() || blocks == 0) return s;
  if (n_spans < 1 || spans == 0 || mask == 0 || ends == 0) return Status(Code::kInvalidArgument, "delta gather: no spans or scratch");
  void* args[] = {&spans, &n_spans, &unit, &mask, &ends, &positions, &values};
  return launch("p2pw_delta_gather", spans, blocks, kGatherThreads, args, stream);
}

Status payload_checksum(uint64_t words, uint64_t n_words, uint64_t out, uint64_t stream) {
  if (out == 0) return Status(Code::kInvalidArgument, "payload checksum: no output");
  if (n_words == 0) return Status::Ok();
  const uint64_t want = (n_words + 255) / 256;
  const unsigned grid = static_cast<unsigned>(want < kChecksumBlocks ? want : kChecksumBlocks);
  void* args[] = {&words, &n_words, &out};
  return launch("p2pw_payload_checksum", out, grid, 256, args, stream);
}

}  // namespace p2pw
