// Delta records (issue 24): one slot's change since the bytes last committed there (its base),
// encoded on the sender and applied on the engine rank. A record may arrive torn or corrupted over
// the network, so it is self-describing and checked in full before any byte is applied.
//
// Layout, little-endian: a 48-byte header, then payload_bytes of payload.
//    0  magic          u32  'P2PD' (bytes 50 32 50 44)
//    4  version        u16  1
//    6  mode           u16  0 EMPTY, 1 RUNS, 2 DENSE
//    8  unit           u32  1, 2, 4 or 8: the bytes compared as one (2 for BF16 elements)
//   12  reserved       u32  0
//   16  slot_nbytes    u64  the slot's bytes: the record applies only to a destination of this size
//   24  payload_bytes  u64  bytes after the header (the record is self-delimiting: bytes past
//                           48 + payload_bytes are never read)
//   32  run_count      u64  EMPTY 0, DENSE 1, RUNS the number of runs (>= 1)
//   40  checksum       u64  delta_hash(payload, seed = delta_hash(header bytes 0..39, seed 0)):
//                           catches a torn or corrupted record, not an attacker
//   48  payload
// Unit i covers bytes [i * unit, min((i + 1) * unit, slot_nbytes)): the last unit may be short.
// EMPTY: no payload, nothing changed. DENSE: the whole slot's bytes. RUNS: run_count records
//   varint gap      units from the previous run's end to this run's start (from unit 0 for the
//                   first run); >= 1 after the first run, so runs never touch or overlap
//   varint length   units in the run (>= 1)
//   bytes           the run's bytes, copied as they are (the short last unit's bytes only)
// varint: unsigned LEB128, at most 10 bytes, never overlong (no final 0x00 byte after others).
//
// The encoder joins two runs when the unchanged units between them cost no more than the smallest
// run header (kMergeBytes; those units equal the base, so writing them is exact), and picks DENSE
// whenever RUNS would not be smaller than the slot. The output depends only on cur, base and unit,
// never on the thread count.
#pragma once

#include <cstdint>
#include <vector>

#include "buffers/copy_program.h"
#include "status.h"

namespace p2pw {

constexpr uint32_t kDeltaMagic = 0x44503250u;  // "P2PD" read as a little-endian u32
constexpr uint16_t kDeltaVersion = 1;
constexpr uint64_t kDeltaHeaderBytes = 48;
constexpr uint64_t kMergeBytes = 2;      // a gap of at most this many bytes is written rather than a new run
constexpr uint64_t kMinRunRecord = 3;    // a run record's least bytes: two 1-byte varints and one byte
constexpr int kMaxDeltaThreads = 64;
constexpr uint64_t kMinDeltaPartBytes = 1ull << 20;  // slots split across threads in parts of at least this

enum class DeltaMode : uint16_t { kEmpty = 0, kRuns = 1, kDense = 2 };
const char* delta_mode_name(DeltaMode m);

struct DeltaStats {
  uint64_t encoded_bytes = 0;  // header + payload: what the record occupies
  uint64_t changed_bytes = 0;  // bytes of the units that differ (exact in every mode)
  uint64_t runs = 0;           // the record's run_count
  DeltaMode mode = DeltaMode::kEmpty;
};

// The most bytes a record of an nbytes slot takes (header + nbytes, as DENSE caps it); 0 when that
// does not fit in 64 bits.
uint64_t delta_max_encoded(uint64_t nbytes);

// The record of cur against base (nbytes each), compared in units of `unit` bytes, written to out
// (out_cap >= delta_max_encoded(nbytes)). update_base: base := cur on the way (only the changed
// bytes are written, or all of them where DENSE is chosen), so no second pass is needed. threads:
// parts of at least kMinDeltaPartBytes scanned side by side (the output is the same for any count;
// the parts' records wait in heap buffers until they are joined, kept for the next encode: up to
// about the largest such record's size stays allocated).
// out may not overlap cur or base; with update_base, cur and base may not overlap either.
// kInvalidArgument for a bad unit, a short out, null or overlapping ranges.
Status delta_encode(const uint8_t* cur, uint8_t* base, uint64_t nbytes, uint32_t unit, uint8_t* out,
                    uint64_t out_cap, DeltaStats* stats, bool update_base = false, int threads = 1);

// delta_encode(update_base = true) of slot bytes [offset, offset + nbytes) as the copy program
// (copy_program.h) would write them, read straight from its inputs through its descriptors: the
// same record, stats and base after, without writing the slot (its bytes are made a window at a
// time, in cache; each changed stretch goes to base as it is found and runs are copied from there).
// A DENSE record's payload is base's bytes after the encode, which are the range's. Checks:
// check_program, a range inside slot_bytes, base and out overlapping no input nor each other, and
// the descriptors writing into the range disjoint (check_disjoint_writes). kNotFound, with nothing
// read or written, when those descriptors leave some byte of the range unwritten: the slot keeps
// bytes there that only the slot holds, so run the program and delta_encode the slot instead.
Status delta_encode_program(const int64_t* program, size_t count, uint64_t slot_bytes,
                            const std::vector<CopyInput>& inputs, uint64_t offset, uint64_t nbytes, uint8_t* base,
                            uint32_t unit, uint8_t* out, uint64_t out_cap, DeltaStats* stats, int threads = 1);

// Validates a record before any byte of it is applied: header fields, slot_nbytes == dst_nbytes,
// the payload inside rec_len, the checksum, every varint, every run inside the slot and after the
// previous one, and that the runs account for the payload exactly. Reads nothing outside
// [rec, rec + rec_len). kInvalidArgument for a malformed or corrupted record, kOutOfRegion for a
// record of another slot size or a run outside the slot; the message names the field or run.
Status delta_check(const uint8_t* rec, uint64_t rec_len, uint64_t dst_nbytes);

// delta_check, then each run copied into dst. Nothing is written when the check fails. rec and dst
// may not overlap. checked: the caller ran delta_check on these very bytes (a delta area checks
// every record, and their digest, before it applies the first): the checksum and the checking walk
// are skipped, one walk copies. That walk still bounds every run inside dst before its copy, so
// bytes changed since the check (a writer racing the end) never store outside dst; they may end
// the apply partway with an error, some runs applied: the caller's update fails (torn), as on any
// failed apply.
Status delta_apply(const uint8_t* rec, uint64_t rec_len, uint8_t* dst, uint64_t dst_nbytes, bool checked = false);

// The record checksum's hash (64-bit, four lanes of multiply-rotate mixing): exposed so tools and
// tests can seal a record.
uint64_t delta_hash(const uint8_t* p, uint64_t n, uint64_t seed);

}  // namespace p2pw
