// Checking and applying delta records (layout: delta_codec.h). Everything about a record is
// checked before the first byte lands: a record comes over the network and may be torn or forged.
#include <cstdio>
#include <cstring>
#include <string>

#include "buffers/delta_codec.h"
#include "buffers/delta_format.h"
#include "checked_math.h"

namespace p2pw {
namespace {

using namespace delta_format;

Status invalid(const std::string& m) { return Status(Code::kInvalidArgument, "delta record: " + m); }
Status outside(const std::string& m) { return Status(Code::kOutOfRegion, "delta record: " + m); }

struct Header {
  DeltaMode mode;
  uint32_t unit;
  uint64_t payload_bytes, run_count;
};

// verify_sum: the checksum too (a pass over the payload); off for a record the caller checked already
Status read_header(const uint8_t* rec, uint64_t rec_len, uint64_t dst_nbytes, Header* h, bool verify_sum = true) {
  if (!rec) return invalid("no record (null address)");
  if (rec_len < kDeltaHeaderBytes)
    return invalid(std::to_string(rec_len) + " bytes, shorter than the 48-byte header");
  if (get<uint32_t>(rec) != kDeltaMagic) {
    char magic[11];
    std::snprintf(magic, sizeof magic, "0x%08x", get<uint32_t>(rec));
    return invalid(std::string("bad magic ") + magic + ", not 'P2PD' (0x44503250)");
  }
  if (get<uint16_t>(rec + 4) != kDeltaVersion)
    return invalid("format version " + std::to_string(get<uint16_t>(rec + 4)) + ", this build reads version 1");
  const uint16_t mode = get<uint16_t>(rec + 6);
  if (mode > 2) return invalid("unknown mode " + std::to_string(mode) + " (0 empty, 1 runs, 2 dense)");
  h->mode = static_cast<DeltaMode>(mode);
  h->unit = get<uint32_t>(rec + 8);
  if (h->unit != 1 && h->unit != 2 && h->unit != 4 && h->unit != 8)
    return invalid("unit " + std::to_string(h->unit) + " is not 1, 2, 4 or 8");
  if (get<uint32_t>(rec + 12) != 0) return invalid("reserved header field is not 0");
  const uint64_t slot_nbytes = get<uint64_t>(rec + 16);
  if (slot_nbytes != dst_nbytes)
    return outside("slot_nbytes " + std::to_string(slot_nbytes) + " is not the destination's " + std::to_string(dst_nbytes));
  h->payload_bytes = get<uint64_t>(rec + 24);
  h->run_count = get<uint64_t>(rec + 32);
  if (h->payload_bytes > rec_len - kDeltaHeaderBytes)
    return invalid("payload_bytes " + std::to_string(h->payload_bytes) + " pass the record's " + std::to_string(rec_len) +
                   " bytes");
  const std::string counts = "payload_bytes " + std::to_string(h->payload_bytes) + ", run_count " + std::to_string(h->run_count);
  if (h->mode == DeltaMode::kEmpty && (h->payload_bytes || h->run_count)) return invalid("empty mode with " + counts);
  if (h->mode == DeltaMode::kDense && (h->payload_bytes != slot_nbytes || h->run_count != 1))
    return invalid("dense mode with " + counts + " (want the slot's bytes and 1 run)");
  if (h->mode == DeltaMode::kRuns && (h->run_count == 0 || h->run_count > h->payload_bytes / kMinRunRecord))
    return invalid("runs mode with " + counts + " (each run takes at least 3 bytes)");
  if (!verify_sum) return Status::Ok();
  const uint64_t sum = delta_hash(rec + kDeltaHeaderBytes, h->payload_bytes, delta_hash(rec, 40, 0));
  if (sum != get<uint64_t>(rec + 40)) return invalid("checksum mismatch (a torn or corrupted record)");
  return Status::Ok();
}

// Every run of a RUNS payload checked; copied into dst too where dst is given. (Messages are built
// only for a refusal: a payload holds millions of runs.)
Status walk_runs(const Header& h, const uint8_t* payload, uint64_t nbytes, uint8_t* dst) {
  const uint64_t unit = h.unit;
  const uint64_t units = nbytes / unit + (nbytes % unit != 0);
  const uint8_t* q = payload;
  const uint8_t* end = payload + h.payload_bytes;
  uint64_t prev_end = 0;
  for (uint64_t i = 0; i < h.run_count; ++i) {
    auto run = [i] { return "run " + std::to_string(i); };
    uint64_t gap = 0, len = 0;
    if (const char* why = get_varint(&q, end, &gap)) return invalid(run() + ": its gap " + why);
    if (const char* why = get_varint(&q, end, &len)) return invalid(run() + ": its length " + why);
    if (len == 0) return invalid(run() + " is empty");
    if (i > 0 && gap == 0) return invalid(run() + " touches the run before it (gap 0)");
    uint64_t start = 0;
    if (!checked_add(prev_end, gap, &start) || start >= units)
      return outside(run() + " starts past the slot's " + std::to_string(units) + " units");
    if (len > units - start)
      return outside(run() + " (units " + std::to_string(start) + " + " + std::to_string(len) + ") ends past the slot's " +
                     std::to_string(units) + " units");
    const uint64_t stop = start + len;
    const uint64_t bytes = (stop == units ? nbytes : stop * unit) - start * unit;
    if (bytes > static_cast<uint64_t>(end - q))
      return invalid(run() + " needs " + std::to_string(bytes) + " bytes, past the payload's end");
    if (dst) copy_exact(dst + start * unit, q, bytes);
    q += bytes;
    prev_end = stop;
  }
  if (q != end) return invalid(std::to_string(end - q) + " payload bytes after the last run");
  return Status::Ok();
}

}  // namespace

Status delta_check(const uint8_t* rec, uint64_t rec_len, uint64_t dst_nbytes) {
  if (!range_fits(reinterpret_cast<uintptr_t>(rec), rec_len))
    return Status(Code::kInvalidArgument, "delta check: the record's range wraps the address space");
  Header h;
  Status s = read_header(rec, rec_len, dst_nbytes, &h);
  if (!s.ok() || h.mode != DeltaMode::kRuns) return s;
  return walk_runs(h, rec + kDeltaHeaderBytes, dst_nbytes, nullptr);
}

Status delta_apply(const uint8_t* rec, uint64_t rec_len, uint8_t* dst, uint64_t dst_nbytes, bool checked) {
  if (dst_nbytes && !dst) return Status(Code::kInvalidArgument, "delta apply: null destination");
  if (!range_fits(reinterpret_cast<uintptr_t>(dst), dst_nbytes) || !range_fits(reinterpret_cast<uintptr_t>(rec), rec_len))
    return Status(Code::kInvalidArgument, "delta apply: a range wraps the address space");
  if (overlap(rec, rec_len, dst, dst_nbytes)) return Status(Code::kInvalidArgument, "delta apply: the record overlaps dst");
  Header h;
  Status s = read_header(rec, rec_len, dst_nbytes, &h, !checked);
  if (!s.ok()) return s;
  const uint8_t* payload = rec + kDeltaHeaderBytes;
  if (h.mode == DeltaMode::kDense) {
    if (dst_nbytes) std::memcpy(dst, payload, dst_nbytes);
  } else if (h.mode == DeltaMode::kRuns) {
    // the whole record first, so nothing lands from a bad one; a caller that checked these bytes
    // already saves that pass (the copying walk still bounds every run before its copy)
    if (!checked) s = walk_runs(h, payload, dst_nbytes, nullptr);
    if (s.ok()) s = walk_runs(h, payload, dst_nbytes, dst);
  }
  return s;
}

}  // namespace p2pw
