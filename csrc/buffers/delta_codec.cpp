// The delta encoder (layout: delta_codec.h): one pass over cur and base finds the changed units,
// joins them into runs and writes their records; parts of a large slot are scanned side by side and
// stitched so that the record is the one a single scan would write.
#include "buffers/delta_codec.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__SSE2__) && !defined(DELTA_CODEC_PORTABLE_ONLY)
#include <emmintrin.h>
#endif

#include "buffers/copy_program.h"
#include "buffers/delta_format.h"
#include "checked_math.h"

namespace p2pw {

namespace {

using namespace delta_format;

// The top bit of each unit-wide lane of a word.
template <uint32_t U>
constexpr uint64_t lane_tops() {
  return U == 1 ? 0x8080808080808080ull : U == 2 ? 0x8000800080008000ull : U == 4 ? 0x8000000080000000ull : 0x8000000000000000ull;
}
// x = cur ^ base: the top bit of each lane that is not zero (no carry crosses a lane).
template <uint32_t U>
inline uint64_t changed_lanes(uint64_t x) {
  constexpr uint64_t low = ~lane_tops<U>();
  return (((x & low) + low) | x) & lane_tops<U>();
}

constexpr uint64_t kGroupAlign = 512;  // bytes of 64 units of the largest unit

struct Run {
  uint64_t start = 0, end = 0;  // units, [start, end)
};

// The slot being encoded. A copy program's range (delta_encode_program) has no cur: its bytes come
// in windows (Scanner::scan_window), each changed stretch is committed to base as it is found
// (commit_on_scan), and the writers copy a run's bytes from base, which equals cur there by then.
struct Slot {
  const uint8_t* cur;
  uint8_t* base;
  uint64_t nbytes;
  uint32_t unit;
  bool update_base;          // commit each run as it is written (not with commit_on_scan)
  const uint8_t* runs_from;  // where the writers copy a run's bytes: cur, or base (commit_on_scan)
  bool commit_on_scan = false;
  uint64_t run_bytes(const Run& r) const { return std::min(r.end * unit, nbytes) - r.start * unit; }
  void commit(const Run& r) const {
    if (update_base) copy_exact(base + r.start * unit, cur + r.start * unit, run_bytes(r));
  }
};

// Records written straight into a RUNS payload; stopped() (and every later run ignored) once the
// payload would reach the slot's size: then DENSE is no larger.
class RecordWriter {
 public:
  RecordWriter(const Slot& slot, uint8_t* payload, bool commit) : slot_(slot), payload_(payload), commit_(commit) {}
  bool stopped() const { return stopped_; }
  void emit(const Run& r) {
    if (stopped_) return;
    const uint64_t bytes = slot_.run_bytes(r);
    const uint64_t rec = varint_len(r.start - prev_end_) + varint_len(r.end - r.start) + bytes;
    if (rec >= slot_.nbytes - pos_) {  // pos_ < nbytes always: RUNS would reach the slot's size
      stopped_ = true;
      return;
    }
    uint8_t* p = put_varint(put_varint(payload_ + pos_, r.start - prev_end_), r.end - r.start);
    copy_exact(p, slot_.runs_from + r.start * slot_.unit, bytes);
    if (commit_) slot_.commit(r);
    pos_ += rec;
    prev_end_ = r.end;
    ++runs_;
  }
  // records already encoded (a part's middle runs), the last ending at unit `end`
  void append(const uint8_t* recs, uint64_t n, uint64_t count, uint64_t end) {
    if (stopped_ || n == 0) return;
    if (n >= slot_.nbytes - pos_) {
      stopped_ = true;
      return;
    }
    std::memcpy(payload_ + pos_, recs, n);
    pos_ += n;
    prev_end_ = end;
    runs_ += count;
  }
  uint64_t bytes() const { return pos_; }
  uint64_t runs() const { return runs_; }

 private:
  const Slot& slot_;
  uint8_t* payload_;
  bool commit_;
  bool stopped_ = false;
  uint64_t pos_ = 0, prev_end_ = 0, runs_ = 0;
};

// The heap buffers that parts encode into, kept from one encode to the next: fresh pages cost a
// fault each (several ms per encode on a VM), so a steady encode reuses them. Holds up to about the
// largest multi-threaded record's size.
class PartBuffers {
 public:
  std::vector<uint8_t> take() {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.empty()) return {};
    std::vector<uint8_t> b = std::move(free_.back());
    free_.pop_back();
    return b;
  }
  void give(std::vector<uint8_t>&& b) {
    std::lock_guard<std::mutex> lock(mu_);
    if (free_.size() < static_cast<size_t>(kMaxDeltaThreads)) free_.push_back(std::move(b));
  }

 private:
  std::mutex mu_;
  std::vector<std::vector<uint8_t>> free_;
};
PartBuffers g_part_buffers;

// One thread's part of the slot: its first closed run kept aside (the stitch may join it to the
// previous part's last run), the next ones encoded, the one open at the part's end returned.
class PartWriter {
 public:
  explicit PartWriter(const Slot& slot) : slot_(slot) {}
  void emit(const Run& r) {
    slot_.commit(r);
    if (!has_first) {
      has_first = true;
      first = r;
    } else {
      const uint64_t bytes = slot_.run_bytes(r);
      if (middle.size() < middle_bytes + 20 + bytes) middle.resize(std::max(2 * middle.size(), middle_bytes + 20 + bytes));
      uint8_t* at = middle.data() + middle_bytes;
      uint8_t* p = put_varint(put_varint(at, r.start - middle_end), r.end - r.start);
      copy_exact(p, slot_.runs_from + r.start * slot_.unit, bytes);
      middle_bytes += static_cast<uint64_t>(p + bytes - at);
      ++middle_runs;
    }
    middle_end = r.end;
  }
  bool has_first = false;
  Run first;
  std::vector<uint8_t> middle;  // the encoded runs after the first: middle_bytes of it
  uint64_t middle_bytes = 0, middle_runs = 0, middle_end = 0;

 private:
  const Slot& slot_;
};

// Finds the changed units of bytes [b0, b1) (b0 a multiple of kGroupAlign; b1 one too, or the
// slot's end) 64 units at a time, as a bitmap whose runs of ones become runs, and hands the sink each
// run once closed; the run open at b1 stays in `open`.
template <uint32_t U, class Sink>
class Scanner {
 public:
  static constexpr uint64_t kGroup = 64 * U;  // bytes of 64 units
  Scanner(const Slot& slot, Sink* sink) : slot_(slot), sink_(sink) {}
  void scan(uint64_t b0, uint64_t b1) { scan_window(b0, b1, slot_.cur + b0); }
  // The same, the cur bytes [b0, b1) read from c0 (a window of them): consecutive windows scan as
  // one range does.
  void scan_window(uint64_t b0, uint64_t b1, const uint8_t* c0) {
    const uint8_t* b = slot_.base;
    uint64_t p = b0;
    for (; p + kGroup <= b1; p += kGroup) {
      const uint64_t bits = bitmap(c0 + (p - b0), b + p);
      if (bits) group(p / U, bits, c0 + (p - b0));  // most of a slot is unchanged
    }
    if (p < b1) {  // the slot's last bytes, zero-padded on both sides
      uint8_t tc[kGroup] = {}, tb[kGroup] = {};
      std::memcpy(tc, c0 + (p - b0), b1 - p);
      std::memcpy(tb, b + p, b1 - p);
      const uint64_t bits = bitmap(tc, tb);
      const uint64_t last = (slot_.nbytes - 1) / U - p / U;  // the slot's last unit, maybe short
      short_changed_ = slot_.nbytes % U && ((bits >> last) & 1);
      if (bits) group(p / U, bits, c0 + (p - b0));
    }
  }
  uint64_t changed_bytes() const { return changed_units_ * U - (short_changed_ ? U - slot_.nbytes % U : 0); }
  bool has_open = false;
  Run open;

 private:
  // bit i: unit i of the 64 from c / b differs
  static uint64_t bitmap(const uint8_t* c, const uint8_t* b) {
#if defined(__SSE2__) && !defined(DELTA_CODEC_PORTABLE_ONLY)
    // lanes compared as lanes: one movemask per 16 units (per 2 for unit 8)
    auto ld = [](const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
    uint64_t same = 0;
    if (U == 1) {
      for (int i = 0; i < 4; ++i)
        same |= static_cast<uint64_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(ld(c + 16 * i), ld(b + 16 * i)))) << (16 * i);
    } else if (U == 2) {
      for (int i = 0; i < 4; ++i) {
        const __m128i lo = _mm_cmpeq_epi16(ld(c + 32 * i), ld(b + 32 * i));
        const __m128i hi = _mm_cmpeq_epi16(ld(c + 32 * i + 16), ld(b + 32 * i + 16));
        same |= static_cast<uint64_t>(_mm_movemask_epi8(_mm_packs_epi16(lo, hi))) << (16 * i);
      }
    } else if (U == 4) {
      for (int i = 0; i < 4; ++i) {
        __m128i q[4];
        for (int j = 0; j < 4; ++j) q[j] = _mm_cmpeq_epi32(ld(c + 64 * i + 16 * j), ld(b + 64 * i + 16 * j));
        const __m128i words = _mm_packs_epi16(_mm_packs_epi32(q[0], q[1]), _mm_packs_epi32(q[2], q[3]));
        same |= static_cast<uint64_t>(_mm_movemask_epi8(words)) << (16 * i);
      }
    } else {
      for (int i = 0; i < 32; ++i) {
        const __m128i v = _mm_cmpeq_epi32(ld(c + 16 * i), ld(b + 16 * i));  // both halves of a lane equal
        same |= static_cast<uint64_t>(_mm_movemask_pd(_mm_castsi128_pd(_mm_and_si128(v, _mm_shuffle_epi32(v, 0xB1)))))
                << (2 * i);
      }
    }
    return ~same;
#else
    uint64_t bits = 0;
    for (uint64_t w = 0; w < 8 * U; ++w) bits |= gather(changed_lanes<U>(load64(c + 8 * w) ^ load64(b + 8 * w))) << (w * (8 / U));
    return bits;
#endif
  }
  // the lanes' top bits as the low 8 / U bits (each multiply lands every bit on its own position)
  static uint64_t gather(uint64_t m) {
    if (U == 1) return ((m >> 7) * 0x0102040810204080ull) >> 56;
    if (U == 2) return (((m >> 15) * 0x0001000200040008ull) >> 48) & 0xF;
    if (U == 4) return ((m >> 31) & 1) | ((m >> 62) & 2);
    return m >> 63;
  }
  // c: the cur bytes of unit u0
  void group(uint64_t u0, uint64_t bits, const uint8_t* c) {
    while (bits) {
      const int s = __builtin_ctzll(bits);
      const uint64_t ones = ~(bits >> s);
      const int len = ones ? __builtin_ctzll(ones) : 64 - s;
      changed_units_ += static_cast<uint64_t>(len);
      if (slot_.commit_on_scan) {  // base := cur over the changed units (the short last one's bytes only)
        const uint64_t from = static_cast<uint64_t>(s) * U;
        const uint64_t to = std::min((u0 + s + len) * U, slot_.nbytes) - u0 * U;
        copy_exact(slot_.base + u0 * U + from, c + from, to - from);
      }
      run(u0 + s, u0 + s + len);
      bits = s + len >= 64 ? 0 : bits & (~0ull << (s + len));
    }
  }
  void run(uint64_t start, uint64_t end) {
    if (has_open) {
      if (start - open.end <= kMergeBytes / U) {
        open.end = end;
        return;
      }
      sink_->emit(open);
    }
    has_open = true;
    open = Run{start, end};
  }

  const Slot& slot_;
  Sink* sink_;
  uint64_t changed_units_ = 0;
  bool short_changed_ = false;
};

struct Encoded {
  bool dense = false;
  uint64_t payload = 0, runs = 0, changed = 0;
};

// Where the scanners read cur: a Source's scan(scanner, b0, b1) scans bytes [b0, b1). The slot's own
// bytes (delta_encode); ProgramSource below makes them in windows from a copy program.
struct SlotSource {
  template <class S>
  void scan(S& s, uint64_t b0, uint64_t b1) const {
    s.scan(b0, b1);
  }
};

template <uint32_t U, class Source>
Encoded encode_one(const Slot& slot, const Source& source, uint8_t* payload) {
  RecordWriter w(slot, payload, true);
  Scanner<U, RecordWriter> s(slot, &w);
  source.scan(s, 0, slot.nbytes);
  if (s.has_open) w.emit(s.open);
  return Encoded{w.stopped(), w.bytes(), w.runs(), s.changed_bytes()};
}

template <uint32_t U, class Source>
Encoded encode_parts(const Slot& slot, const Source& source, uint8_t* payload, int parts) {
  // part bounds: multiples of kGroupAlign bytes (so of a scan group), the last one at the slot's end
  std::vector<uint64_t> bound(parts + 1);
  const uint64_t step = (slot.nbytes / parts + kGroupAlign - 1) / kGroupAlign * kGroupAlign;
  for (int k = 0; k <= parts; ++k) bound[k] = std::min(slot.nbytes, step * k);
  bound[parts] = slot.nbytes;
  std::vector<PartWriter> writers(parts, PartWriter(slot));
  for (auto& pw : writers) pw.middle = g_part_buffers.take();
  std::vector<Run> last(parts);
  std::vector<char> has_last(parts, 0);
  std::vector<uint64_t> changed(parts, 0);
  auto work = [&](int k) {
    Scanner<U, PartWriter> s(slot, &writers[k]);
    source.scan(s, bound[k], bound[k + 1]);
    if (s.has_open) slot.commit(s.open);
    last[k] = s.open;
    has_last[k] = s.has_open;
    changed[k] = s.changed_bytes();
  };
  std::vector<std::thread> pool;
  for (int k = 1; k < parts; ++k) {
    try {
      pool.emplace_back(work, k);
    } catch (const std::system_error&) {  // no thread to be had: this part on the calling thread
      work(k);
    }
  }
  work(0);
  for (auto& t : pool) t.join();
  uint64_t changed_bytes = 0;
  for (uint64_t c : changed) changed_bytes += c;
  // stitch: the first run of a part joins the run open before it exactly as one scan would have
  RecordWriter w(slot, payload, false);
  bool has_pending = false;
  Run pending;
  auto take = [&](const Run& r) {
    if (has_pending && r.start - pending.end <= kMergeBytes / U) {
      pending.end = r.end;
      return;
    }
    if (has_pending) w.emit(pending);
    pending = r;
    has_pending = true;
  };
  for (int k = 0; k < parts; ++k) {
    const PartWriter& pw = writers[k];
    if (pw.has_first) {
      take(pw.first);
      if (pw.middle_runs) {
        w.emit(pending);
        has_pending = false;
        w.append(pw.middle.data(), pw.middle_bytes, pw.middle_runs, pw.middle_end);
      }
    }
    if (has_last[k]) take(last[k]);
  }
  if (has_pending) w.emit(pending);
  for (auto& pw : writers) g_part_buffers.give(std::move(pw.middle));
  return Encoded{w.stopped(), w.bytes(), w.runs(), changed_bytes};
}

template <uint32_t U, class Source>
Encoded encode_unit(const Slot& slot, const Source& source, uint8_t* payload, int threads) {
  const uint64_t most = std::max<uint64_t>(1, slot.nbytes / kMinDeltaPartBytes);
  const int parts = static_cast<int>(std::min<uint64_t>(std::clamp(threads, 1, kMaxDeltaThreads), most));
  return parts == 1 ? encode_one<U>(slot, source, payload) : encode_parts<U>(slot, source, payload, parts);
}

template <class Source>
Encoded encode_any(const Slot& slot, const Source& source, uint8_t* payload, int threads) {
  switch (slot.unit) {
    case 1: return encode_unit<1>(slot, source, payload, threads);
    case 2: return encode_unit<2>(slot, source, payload, threads);
    case 4: return encode_unit<4>(slot, source, payload, threads);
    default: return encode_unit<8>(slot, source, payload, threads);
  }
}

// The header, and the DENSE payload (from dense_src: the slot's bytes) where RUNS would not be
// smaller.
void seal(const Encoded& e, const uint8_t* dense_src, uint64_t nbytes, uint32_t unit, uint8_t* out, DeltaStats* stats) {
  uint8_t* payload = out + kDeltaHeaderBytes;
  const DeltaMode mode = e.dense ? DeltaMode::kDense : e.runs ? DeltaMode::kRuns : DeltaMode::kEmpty;
  const uint64_t payload_bytes = e.dense ? nbytes : e.payload;
  const uint64_t runs = e.dense ? 1 : e.runs;
  put<uint32_t>(out, kDeltaMagic);
  put<uint16_t>(out + 4, kDeltaVersion);
  put<uint16_t>(out + 6, static_cast<uint16_t>(mode));
  put<uint32_t>(out + 8, unit);
  put<uint32_t>(out + 12, 0);
  put<uint64_t>(out + 16, nbytes);
  put<uint64_t>(out + 24, payload_bytes);
  put<uint64_t>(out + 32, runs);
  const uint64_t seed = delta_hash(out, 40, 0);
  const uint64_t sum = e.dense ? copy_and_hash(payload, dense_src, nbytes, seed) : delta_hash(payload, payload_bytes, seed);
  put<uint64_t>(out + 40, sum);
  if (stats) *stats = DeltaStats{kDeltaHeaderBytes + payload_bytes, e.changed, runs, mode};
}

// -- a copy program's range, compared without writing the slot (delta_encode_program) ------------

constexpr uint64_t kWindowBytes = 64 << 10;  // a multiple of kGroupAlign: windows stay in cache

// One descriptor of a copy program (copy_program.h), its destination relative to the range's first
// byte (it may start before it: a descriptor joined across parameters).
struct Segment {
  const uint8_t* src;  // nullptr: a zero fill
  int64_t dst, row_bytes, rows, dst_pitch, src_pitch;
  int64_t lo, hi;  // its first byte and the end of its last row, clipped to the range

  // the rows [r0, r1) that write some byte of [w0, w1)
  void rows_touching(int64_t w0, int64_t w1, int64_t* r0, int64_t* r1) const {
    if (rows == 1) {
      *r0 = 0;
      *r1 = dst < w1 && dst + row_bytes > w0 ? 1 : 0;
      return;
    }
    const int64_t x = w0 - dst - row_bytes, y = w1 - dst;  // row r touches: r * pitch in (x, y)
    *r0 = x < 0 ? 0 : x / dst_pitch + 1;
    *r1 = y <= 0 ? 0 : std::min(rows, (y + dst_pitch - 1) / dst_pitch);
  }
  int64_t row_part(int64_t r, int64_t w0, int64_t w1) const {
    const int64_t d = dst + r * dst_pitch;
    return std::min(w1, d + row_bytes) - std::max(w0, d);
  }
  // bytes of [w0, w1) it writes (rows between the first and the last touching one lie inside)
  uint64_t bytes_in(int64_t w0, int64_t w1) const {
    int64_t r0, r1;
    rows_touching(w0, w1, &r0, &r1);
    if (r1 <= r0) return 0;
    if (r1 - r0 == 1) return static_cast<uint64_t>(row_part(r0, w0, w1));
    return static_cast<uint64_t>(row_part(r0, w0, w1) + row_part(r1 - 1, w0, w1) + (r1 - r0 - 2) * row_bytes);
  }
  // Its rows' parts in [w0, w1) as (first byte, end, where the first byte lies in its input), when
  // each is read in place by a scan: from an input, at most `most` of them, both ends multiples of
  // `group` (or the range's end). False (out unfinished) where not.
  bool parts_in(int64_t w0, int64_t w1, int64_t group, int64_t end, int64_t most,
                std::vector<std::pair<std::pair<int64_t, int64_t>, const uint8_t*>>* out) const {
    int64_t r0, r1;
    rows_touching(w0, w1, &r0, &r1);
    if (src == nullptr || r1 - r0 > most) return false;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t d = dst + r * dst_pitch;
      const int64_t a = std::max(w0, d), b = std::min(w1, d + row_bytes);
      if (a % group || (b % group && b != end)) return false;
      out->push_back({{a, b}, src + r * src_pitch + (a - d)});
    }
    return true;
  }
  // its bytes of [w0, w1) into win (win[0] is byte w0)
  void fill(uint8_t* win, int64_t w0, int64_t w1) const {
    int64_t r0, r1;
    rows_touching(w0, w1, &r0, &r1);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t d = dst + r * dst_pitch;
      const int64_t a = std::max(w0, d), b = std::min(w1, d + row_bytes);
      if (src)
        std::memcpy(win + (a - w0), src + r * src_pitch + (a - d), static_cast<size_t>(b - a));
      else
        std::memset(win + (a - w0), 0, static_cast<size_t>(b - a));
    }
  }
};

// The range's bytes as the program writes them, a window at a time on the scanning thread: read in
// place from the inputs where the window's rows start and end on scan groups (a 1-D copy; 2-D rows
// of whole groups, as a column shard's), else made in a buffer that stays in cache. The slot is
// never written.
class ProgramSource {
 public:
  ProgramSource(const std::vector<Segment>& segs, uint64_t nbytes) : segs_(segs), end_(static_cast<int64_t>(nbytes)) {}
  template <class S>
  void scan(S& s, uint64_t b0, uint64_t b1) const {
    constexpr int64_t group = static_cast<int64_t>(S::kGroup);
    std::unique_ptr<uint8_t[]> win(new uint8_t[std::min(kWindowBytes, b1 - b0) + 1]);
    std::vector<const Segment*> active;
    std::vector<std::pair<std::pair<int64_t, int64_t>, const uint8_t*>> parts;
    size_t next = 0;
    for (uint64_t w0 = b0; w0 < b1; w0 += kWindowBytes) {
      const uint64_t w1 = std::min(b1, w0 + kWindowBytes);
      const int64_t lo = static_cast<int64_t>(w0), hi = static_cast<int64_t>(w1);
      for (; next < segs_.size() && segs_[next].lo < hi; ++next)
        if (segs_[next].hi > lo) active.push_back(&segs_[next]);
      active.erase(std::remove_if(active.begin(), active.end(), [&](const Segment* g) { return g->hi <= lo; }),
                   active.end());
      parts.clear();
      bool in_place = true;
      for (size_t k = 0; k < active.size() && in_place; ++k)
        in_place = active[k]->parts_in(lo, hi, group, end_, (hi - lo) / group + 1, &parts);
      if (in_place) {  // disjoint and covering the window: in order, one after another
        if (active.size() > 1) std::sort(parts.begin(), parts.end());
        for (const auto& part : parts)
          s.scan_window(static_cast<uint64_t>(part.first.first), static_cast<uint64_t>(part.first.second), part.second);
        continue;
      }
      for (const Segment* g : active) g->fill(win.get(), lo, hi);
      s.scan_window(w0, w1, win.get());
    }
  }

 private:
  const std::vector<Segment>& segs_;
  int64_t end_;
};

}  // namespace

const char* delta_mode_name(DeltaMode m) {
  switch (m) {
    case DeltaMode::kEmpty: return "empty";
    case DeltaMode::kRuns: return "runs";
    case DeltaMode::kDense: return "dense";
  }
  return "unknown";
}

uint64_t delta_hash(const uint8_t* p, uint64_t n, uint64_t seed) {
  Hasher h(seed);
  uint64_t i = 0;
  for (; i + 32 <= n; i += 32) h.block(p + i);
  return h.finish(p + i, n - i, n);
}

uint64_t delta_max_encoded(uint64_t nbytes) {
  uint64_t total = 0;
  return checked_add(nbytes, kDeltaHeaderBytes, &total) ? total : 0;
}

// What both encoders check first: the unit, and an output that holds the worst case (`need`).
static Status check_unit_and_output(uint64_t nbytes, uint32_t unit, const uint8_t* out, uint64_t out_cap, uint64_t* need) {
  if (unit != 1 && unit != 2 && unit != 4 && unit != 8)
    return Status(Code::kInvalidArgument, "delta encode: unit " + std::to_string(unit) + " is not 1, 2, 4 or 8");
  *need = delta_max_encoded(nbytes);
  if (*need == 0) return Status(Code::kInvalidArgument, "delta encode: a slot of 2^64 bytes");
  if (!out || out_cap < *need)
    return Status(Code::kInvalidArgument, "delta encode: the output holds " + std::to_string(out_cap) + " bytes, " +
                                              std::to_string(*need) + " needed (delta_max_encoded)");
  return Status::Ok();
}

Status delta_encode(const uint8_t* cur, uint8_t* base, uint64_t nbytes, uint32_t unit, uint8_t* out, uint64_t out_cap,
                    DeltaStats* stats, bool update_base, int threads) {
  uint64_t need = 0;
  if (Status s = check_unit_and_output(nbytes, unit, out, out_cap, &need); !s.ok()) return s;
  if (nbytes && (!cur || !base)) return Status(Code::kInvalidArgument, "delta encode: null cur or base");
  if (!range_fits(reinterpret_cast<uintptr_t>(cur), nbytes) || !range_fits(reinterpret_cast<uintptr_t>(base), nbytes) ||
      !range_fits(reinterpret_cast<uintptr_t>(out), need))
    return Status(Code::kInvalidArgument, "delta encode: a range wraps the address space");
  if (overlap(out, need, cur, nbytes) || overlap(out, need, base, nbytes))
    return Status(Code::kInvalidArgument, "delta encode: the output overlaps cur or base");
  if (update_base && overlap(cur, nbytes, base, nbytes))
    return Status(Code::kInvalidArgument, "delta encode: update_base with cur and base overlapping");
  const Slot slot{cur, base, nbytes, unit, update_base, cur};
  const Encoded e = encode_any(slot, SlotSource{}, out + kDeltaHeaderBytes, threads);
  seal(e, cur, nbytes, unit, out, stats);
  if (e.dense && update_base) std::memcpy(base, cur, nbytes);
  return Status::Ok();
}

Status delta_encode_program(const int64_t* program, size_t count, uint64_t slot_bytes,
                            const std::vector<CopyInput>& inputs, uint64_t offset, uint64_t nbytes, uint8_t* base,
                            uint32_t unit, uint8_t* out, uint64_t out_cap, DeltaStats* stats, int threads) {
  uint64_t need = 0;
  if (Status s = check_unit_and_output(nbytes, unit, out, out_cap, &need); !s.ok()) return s;
  if (nbytes && !base) return Status(Code::kInvalidArgument, "delta encode: null base");
  uint64_t end = 0;
  if (!checked_add(offset, nbytes, &end) || end > slot_bytes)
    return Status(Code::kOutOfRegion, "delta encode: bytes [" + std::to_string(offset) + ", +" + std::to_string(nbytes) +
                                          ") lie outside a group of " + std::to_string(slot_bytes) + " bytes");
  if (!range_fits(reinterpret_cast<uintptr_t>(base), nbytes) || !range_fits(reinterpret_cast<uintptr_t>(out), need))
    return Status(Code::kInvalidArgument, "delta encode: a range wraps the address space");
  if (overlap(out, need, base, nbytes)) return Status(Code::kInvalidArgument, "delta encode: the output overlaps base");
  Status s = check_program(program, count, slot_bytes, inputs);
  if (!s.ok()) return s;
  for (size_t k = 0; k < inputs.size(); ++k) {
    const void* in = reinterpret_cast<const void*>(inputs[k].address);
    if (overlap(in, inputs[k].nbytes, base, nbytes) || overlap(in, inputs[k].nbytes, out, need))
      return Status(Code::kInvalidArgument, "delta encode: base or the output overlaps copy input " + std::to_string(k));
  }
  // the descriptors that write into the range: disjoint, and every byte of it written by one
  std::vector<int64_t> touching;
  std::vector<Segment> segs;
  uint64_t covered = 0;
  const int64_t r0 = static_cast<int64_t>(offset), r1 = static_cast<int64_t>(end);
  for (size_t i = 0; i < count; ++i) {
    const int64_t* c = program + i * kCopyColumns;
    const int64_t last = c[1] + (c[4] - 1) * c[5] + c[3];  // check_program: inside the slot
    if (last <= r0 || c[1] >= r1) continue;
    touching.insert(touching.end(), c, c + kCopyColumns);
    const uint8_t* src = c[0] < 0 ? nullptr : reinterpret_cast<const uint8_t*>(inputs[c[0]].address) + c[2];
    Segment g{src, c[1] - r0, c[3], c[4], c[5], c[6], std::max<int64_t>(0, c[1] - r0), std::min(r1, last) - r0};
    covered += g.bytes_in(0, r1 - r0);
    segs.push_back(g);
  }
  s = check_disjoint_writes(touching.data(), segs.size());
  if (!s.ok()) return s;
  if (covered != nbytes)
    return Status(Code::kNotFound, "delta encode: the copy program writes " + std::to_string(covered) + " of the " +
                                       std::to_string(nbytes) + " bytes from offset " + std::to_string(offset) +
                                       " (run it into the slot and encode the slot)");
  std::sort(segs.begin(), segs.end(), [](const Segment& a, const Segment& b) { return a.lo < b.lo; });
  const Slot slot{nullptr, base, nbytes, unit, false, base, true};
  const Encoded e = encode_any(slot, ProgramSource(segs, nbytes), out + kDeltaHeaderBytes, threads);
  seal(e, base, nbytes, unit, out, stats);  // base holds the range's new bytes by now
  return Status::Ok();
}

}  // namespace p2pw
