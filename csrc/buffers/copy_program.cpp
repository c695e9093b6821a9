#include "buffers/copy_program.h"

#ifdef P2PW_HAVE_COPY_KERNEL
#include "copy_batch_fatbin.h"
#endif

#include <dlfcn.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <queue>
#include <system_error>
#include <thread>

#include "checked_math.h"

namespace p2pw {

namespace {

// one descriptor, read from the program's columns
struct Copy {
  int64_t input, dst, src, row_bytes, rows, dst_pitch, src_pitch;
  uint64_t bytes() const { return static_cast<uint64_t>(row_bytes) * static_cast<uint64_t>(rows); }
};

Copy at(const int64_t* program, size_t i) {
  const int64_t* c = program + i * kCopyColumns;
  return Copy{c[0], c[1], c[2], c[3], c[4], c[5], c[6]};
}

// Offsets, sizes and pitches of a valid descriptor stay far below 2^62, so extents computed in
// 128 bits cannot overflow and a forged value cannot wrap around into the slot.
constexpr int64_t kLimit = int64_t(1) << 48;

std::string where(size_t i) { return "copy descriptor " + std::to_string(i); }

}  // namespace

Status check_descriptors(const int64_t* program, size_t count, uint64_t slot_bytes, const uint64_t* input_nbytes,
                         size_t num_inputs) {
  if (count > 0 && program == nullptr) return Status(Code::kInvalidArgument, "copy program has no descriptors");
  for (size_t i = 0; i < count; ++i) {
    const Copy c = at(program, i);
    if (c.input < -1 || c.input >= static_cast<int64_t>(num_inputs))
      return Status(Code::kInvalidArgument, where(i) + " names input " + std::to_string(c.input) + " of " +
                                                std::to_string(num_inputs));
    if (c.row_bytes < 1 || c.rows < 1 || c.row_bytes >= kLimit || c.rows >= kLimit)
      return Status(Code::kInvalidArgument, where(i) + " has " + std::to_string(c.rows) + " rows of " +
                                                std::to_string(c.row_bytes) + " bytes");
    if (c.dst < 0 || c.dst >= kLimit || c.dst_pitch >= kLimit || (c.rows > 1 && c.dst_pitch < c.row_bytes))
      return Status(Code::kInvalidArgument, where(i) + " has destination offset " + std::to_string(c.dst) +
                                                " and pitch " + std::to_string(c.dst_pitch) +
                                                " (rows must not overlap)");
    const __int128 dst_end = static_cast<__int128>(c.dst) + static_cast<__int128>(c.rows - 1) * c.dst_pitch + c.row_bytes;
    if (dst_end > static_cast<__int128>(slot_bytes))
      return Status(Code::kOutOfRegion, where(i) + " writes up to byte " + std::to_string(static_cast<int64_t>(dst_end)) +
                                            " of a group of " + std::to_string(slot_bytes) + " bytes");
    if (c.input < 0) continue;
    if (c.src < 0 || c.src >= kLimit || c.src_pitch >= kLimit || c.src_pitch <= -kLimit)
      return Status(Code::kInvalidArgument, where(i) + " has source offset " + std::to_string(c.src) + " and pitch " +
                                                std::to_string(c.src_pitch));
    const __int128 span = static_cast<__int128>(c.rows - 1) * c.src_pitch;
    const __int128 lo = c.src + std::min<__int128>(0, span);
    const __int128 hi = c.src + std::max<__int128>(0, span) + c.row_bytes;
    const uint64_t n = input_nbytes[c.input];
    if (lo < 0 || hi > static_cast<__int128>(n))
      return Status(Code::kOutOfRegion, where(i) + " reads bytes [" + std::to_string(static_cast<int64_t>(lo)) + ", " +
                                            std::to_string(static_cast<int64_t>(hi)) + ") of input " +
                                            std::to_string(c.input) + " of " + std::to_string(n) + " bytes");
  }
  return Status::Ok();
}

Status check_program(const int64_t* program, size_t count, uint64_t slot_bytes, const std::vector<CopyInput>& inputs) {
  std::vector<uint64_t> nbytes(inputs.size());
  for (size_t k = 0; k < inputs.size(); ++k) {
    if (inputs[k].address == 0 && inputs[k].nbytes > 0) return Status(Code::kInvalidArgument, "a copy input has no address");
    if (!range_fits(inputs[k].address, inputs[k].nbytes))
      return Status(Code::kInvalidArgument, "copy input " + std::to_string(k) + " of " + std::to_string(inputs[k].nbytes) +
                                                " bytes runs past the end of the address space");
    nbytes[k] = inputs[k].nbytes;
  }
  return check_descriptors(program, count, slot_bytes, nbytes.data(), nbytes.size());
}

// -- disjoint writes ------------------------------------------------------------------------------
namespace {

constexpr size_t kNone = SIZE_MAX;
constexpr int64_t kMaxEnd = int64_t(1) << 62;  // no slot is this large: ends are refused past it, sums stay in int64
using Pair = std::pair<size_t, size_t>;

// A descriptor's destination bytes seen as lines of `pitch` bytes: cells [line0, line1) x [col0, col1).
struct Rect {
  int64_t line0, line1, col0, col1;
  size_t copy;
};

// The destination bytes of copy i as at most three rectangles; c.rows == 1 or c.dst_pitch == pitch.
// The rectangles of one copy never share a cell (its rows are disjoint: pitch >= row_bytes).
void add_rects(const Copy& c, size_t i, int64_t pitch, std::vector<Rect>* out) {
  if (c.rows > 1) {  // every row starts at the same column of consecutive lines
    const int64_t q = c.dst / pitch, r = c.dst % pitch;
    if (r + c.row_bytes <= pitch) {
      out->push_back(Rect{q, q + c.rows, r, r + c.row_bytes, i});
    } else {  // each row wraps into the next line
      out->push_back(Rect{q, q + c.rows, r, pitch, i});
      out->push_back(Rect{q + 1, q + 1 + c.rows, 0, r + c.row_bytes - pitch, i});
    }
    return;
  }
  const int64_t end = c.dst + c.row_bytes;
  const int64_t q0 = c.dst / pitch, r0 = c.dst % pitch, q1 = end / pitch, r1 = end % pitch;
  if (q0 == q1) {
    out->push_back(Rect{q0, q0 + 1, r0, r1, i});
    return;
  }
  out->push_back(Rect{q0, q0 + 1, r0, pitch, i});
  if (q1 > q0 + 1) out->push_back(Rect{q0 + 1, q1, 0, pitch, i});
  if (r1 > 0) out->push_back(Rect{q1, q1 + 1, 0, r1, i});
}

// Two copies whose rectangles share a cell, or {kNone, kNone}: a sweep over lines keeping the
// column intervals of the rectangles that cover the current line (disjoint until the first overlap).
Pair overlap_of_rects(std::vector<Rect>& rects) {
  std::sort(rects.begin(), rects.end(), [](const Rect& a, const Rect& b) { return a.line0 < b.line0; });
  std::map<int64_t, const Rect*> active;  // by col0
  using Expiry = std::pair<int64_t, int64_t>;  // (line1, col0)
  std::priority_queue<Expiry, std::vector<Expiry>, std::greater<Expiry>> expiry;
  for (const Rect& r : rects) {
    while (!expiry.empty() && expiry.top().first <= r.line0) {
      active.erase(expiry.top().second);
      expiry.pop();
    }
    auto it = active.lower_bound(r.col1);
    if (it != active.begin() && (--it)->second->col1 > r.col0) return {it->second->copy, r.copy};
    active.emplace(r.col0, &r);
    expiry.emplace(r.line1, r.col0);
  }
  return {kNone, kNone};
}

// The same by rows, for copies of several pitches: a merge of every copy's rows (each copy's rows
// ascend) checking each row's start against the furthest end seen so far.
Pair overlap_of_rows(const int64_t* program, const std::vector<size_t>& copies) {
  using Next = std::pair<int64_t, std::pair<size_t, int64_t>>;  // (row start, (copy, row))
  std::priority_queue<Next, std::vector<Next>, std::greater<Next>> rows;
  for (size_t i : copies) rows.push({at(program, i).dst, {i, 0}});
  int64_t furthest = -1;
  size_t owner = kNone;
  while (!rows.empty()) {
    const auto [start, which] = rows.top();
    rows.pop();
    const Copy c = at(program, which.first);
    if (start < furthest) return {owner, which.first};
    if (start + c.row_bytes > furthest) {
      furthest = start + c.row_bytes;
      owner = which.first;
    }
    if (which.second + 1 < c.rows) rows.push({start + c.dst_pitch, {which.first, which.second + 1}});
  }
  return {kNone, kNone};
}

}  // namespace

Status check_disjoint_writes(const int64_t* program, size_t count) {
  struct Box {
    int64_t lo, hi;
    size_t copy;
  };
  std::vector<Box> boxes(count);
  for (size_t i = 0; i < count; ++i) {
    const Copy c = at(program, i);
    const __int128 hi = static_cast<__int128>(c.dst) + static_cast<__int128>(c.rows - 1) * c.dst_pitch + c.row_bytes;
    if (c.rows < 1 || c.row_bytes < 1 || c.dst < 0 || (c.rows > 1 && c.dst_pitch < c.row_bytes) || hi >= kMaxEnd)
      return Status(Code::kInvalidArgument, where(i) + " is malformed (run check_descriptors first)");
    boxes[i] = Box{c.dst, static_cast<int64_t>(hi), i};
  }
  std::sort(boxes.begin(), boxes.end(), [](const Box& a, const Box& b) { return a.lo < b.lo; });
  std::vector<size_t> members;
  std::vector<Rect> rects;
  for (size_t a = 0; a < count;) {
    // a cluster: boxes that overlap one another transitively; only within one can bytes collide
    size_t b = a + 1;
    int64_t end = boxes[a].hi;
    while (b < count && boxes[b].lo < end) end = std::max(end, boxes[b++].hi);
    if (b - a > 1) {
      members.clear();
      int64_t pitch = 0;
      bool one_pitch = true;
      for (size_t k = a; k < b; ++k) {
        members.push_back(boxes[k].copy);
        const Copy c = at(program, boxes[k].copy);
        if (c.rows == 1) continue;
        if (pitch == 0) pitch = c.dst_pitch;
        one_pitch &= c.dst_pitch == pitch;
      }
      Pair hit{kNone, kNone};
      if (one_pitch) {  // the usual case (column shards, interleaved heads): rectangles, whatever the rows
        rects.clear();
        for (size_t i : members) add_rects(at(program, i), i, pitch > 0 ? pitch : kMaxEnd, &rects);
        hit = overlap_of_rects(rects);
      } else {
        hit = overlap_of_rows(program, members);
      }
      if (hit.first != kNone) {
        const size_t i = std::min(hit.first, hit.second), j = std::max(hit.first, hit.second);
        return Status(Code::kOutOfRegion, "copy descriptors " + std::to_string(i) + " and " + std::to_string(j) +
                                              " write overlapping destination bytes (from offsets " +
                                              std::to_string(at(program, i).dst) + " and " +
                                              std::to_string(at(program, j).dst) + ")");
      }
    }
    a = b;
  }
  return Status::Ok();
}

Status check_copy_program(const int64_t* program, size_t count, uint64_t slot_bytes,
                          const std::vector<uint64_t>& input_nbytes) {
  Status s = check_descriptors(program, count, slot_bytes, input_nbytes.data(), input_nbytes.size());
  return s.ok() ? check_disjoint_writes(program, count) : s;
}

// -- host ----------------------------------------------------------------------------------------
namespace {

// a part of one descriptor: rows [row0, row1), and within a single-row copy bytes [byte0, byte1)
struct Piece {
  size_t copy;
  int64_t row0, row1, byte0, byte1;
  uint64_t bytes;
};

void run_piece(const int64_t* program, const Piece& p, uint8_t* slot, const std::vector<CopyInput>& inputs) {
  const Copy c = at(program, p.copy);
  for (int64_t r = p.row0; r < p.row1; ++r) {
    uint8_t* d = slot + c.dst + r * c.dst_pitch + p.byte0;
    const size_t n = static_cast<size_t>(p.byte1 - p.byte0);
    if (c.input < 0) {
      std::memset(d, 0, n);
    } else {
      const uint8_t* s = reinterpret_cast<const uint8_t*>(inputs[c.input].address) + c.src + r * c.src_pitch + p.byte0;
      std::memcpy(d, s, n);
    }
  }
}

// The host copies' helper threads: started on first use, grown to the largest count asked, kept
// for the process (leaked on purpose: joining at exit could wait on a copy). A call's shares are
// taken by index, by the pool's threads and by the caller alike, so a call completes even where
// no helper could be started (or after fork(), which copies no thread).
class CopyPool {
 public:
  static CopyPool& get() {
    static CopyPool* pool = new CopyPool();
    return *pool;
  }

  // work(0) .. work(n - 1), on up to n threads (the caller's included); returns when all are done.
  void run(int n, const std::function<void(int)>& work) {
    auto job = std::make_shared<Job>();
    job->work = &work;
    job->n = n;
    {
      std::lock_guard<std::mutex> lk(mu_);
      while (static_cast<int>(threads_.size()) < std::min(n, kMaxCopyThreads) - 1) {
        try {
          threads_.emplace_back([this] { serve(); });
        } catch (const std::system_error&) {
          break;  // fewer helpers: the caller takes the shares left
        }
      }
      queue_.push_back(job);
    }
    cv_.notify_all();
    job->take();
    {
      std::lock_guard<std::mutex> lk(mu_);  // every share is taken: no helper needs to find it
      auto it = std::find(queue_.begin(), queue_.end(), job);
      if (it != queue_.end()) queue_.erase(it);
    }
    std::unique_lock<std::mutex> lk(job->mu);
    job->all_done.wait(lk, [&] { return job->done == job->n; });
  }

 private:
  struct Job {
    const std::function<void(int)>* work = nullptr;
    int n = 0;
    std::atomic<int> next{0};
    std::mutex mu;
    std::condition_variable all_done;
    int done = 0;  // under mu

    void take() {  // runs shares until none is left to take
      for (int w; (w = next.fetch_add(1)) < n;) {
        (*work)(w);
        std::lock_guard<std::mutex> lk(mu);
        if (++done == n) all_done.notify_all();
      }
    }
  };

  void serve() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return !queue_.empty(); });
        job = queue_.front();
        if (job->next.load() >= job->n) {  // all taken: let the next call's job come to the front
          queue_.pop_front();
          continue;
        }
      }
      job->take();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::vector<std::thread> threads_;
};

}  // namespace

Status run_host_program(const int64_t* program, size_t count, uint64_t slot, uint64_t slot_bytes,
                        const std::vector<CopyInput>& inputs, int threads) {
  if (slot == 0 && count > 0) return Status(Code::kInvalidArgument, "copy program has no slot");
  if (!range_fits(slot, slot_bytes))
    return Status(Code::kInvalidArgument, "a slot of " + std::to_string(slot_bytes) + " bytes runs past the end of the address space");
  Status s = check_program(program, count, slot_bytes, inputs);
  if (!s.ok()) return s;
  uint8_t* dst = reinterpret_cast<uint8_t*>(slot);
  uint64_t total = 0;
  for (size_t i = 0; i < count; ++i) total += at(program, i).bytes();
  threads = std::max(1, std::min(threads, kMaxCopyThreads));
  if (threads == 1 || total < kInlineCopyBytes) {
    for (size_t i = 0; i < count; ++i) {
      const Copy c = at(program, i);
      run_piece(program, Piece{i, 0, c.rows, 0, c.row_bytes, c.bytes()}, dst, inputs);
    }
    return Status::Ok();
  }
  // Cut the copies into pieces of at most `piece` bytes (a long 1-D copy by bytes, a 2-D one by
  // rows), then hand each thread a run of pieces holding about total / threads bytes.
  const uint64_t piece = std::max<uint64_t>(256 << 10, total / (static_cast<uint64_t>(threads) * 4));
  std::vector<Piece> pieces;
  for (size_t i = 0; i < count; ++i) {
    const Copy c = at(program, i);
    if (c.rows == 1) {
      for (int64_t b = 0; b < c.row_bytes; b += static_cast<int64_t>(piece)) {
        const int64_t e = std::min<int64_t>(c.row_bytes, b + static_cast<int64_t>(piece));
        pieces.push_back(Piece{i, 0, 1, b, e, static_cast<uint64_t>(e - b)});
      }
    } else {
      const int64_t step = std::max<int64_t>(1, static_cast<int64_t>(piece) / c.row_bytes);
      for (int64_t r = 0; r < c.rows; r += step) {
        const int64_t e = std::min<int64_t>(c.rows, r + step);
        pieces.push_back(Piece{i, r, e, 0, c.row_bytes, static_cast<uint64_t>(e - r) * c.row_bytes});
      }
    }
  }
  std::vector<size_t> first(threads + 1, pieces.size());
  first[0] = 0;
  uint64_t seen = 0;
  int t = 1;
  for (size_t k = 0; k < pieces.size() && t < threads; ++k) {
    while (t < threads && seen >= total * t / threads) first[t++] = k;
    seen += pieces[k].bytes;
  }
  CopyPool::get().run(threads, [&](int w) {
    for (size_t k = first[w]; k < first[w + 1]; ++k) run_piece(program, pieces[k], dst, inputs);
  });
  return Status::Ok();
}

// -- CUDA driver ----------------------------------------------------------------------------------
namespace {

// The few driver API types used, as cuda.h declares them (ABI of CUDA 12.x and later).
using CUresult = int;
using CUdeviceptr = unsigned long long;
using CUcontext = void*;
using CUstream = void*;
using CUevent = void*;
using CUmodule = void*;
using CUfunction = void*;
constexpr CUresult kCudaSuccess = 0;
constexpr CUresult kCudaNotInitialized = 3;
constexpr int kPointerAttributeContext = 1;  // CU_POINTER_ATTRIBUTE_CONTEXT
constexpr int kMemoryTypeUnified = 4;        // CU_MEMORYTYPE_UNIFIED: the *Device field is a UVA address
constexpr unsigned kStreamNonBlocking = 0x1;   // CU_STREAM_NON_BLOCKING: no implicit sync with the legacy stream
constexpr unsigned kEventDisableTiming = 0x2;  // CU_EVENT_DISABLE_TIMING
constexpr int64_t kMaxPitch = 2147483647;    // cuMemcpy2D's pitch limit (CU_DEVICE_ATTRIBUTE_MAX_PITCH)

struct Memcpy2D {  // CUDA_MEMCPY2D (v2)
  size_t srcXInBytes, srcY;
  int srcMemoryType;
  const void* srcHost;
  CUdeviceptr srcDevice;
  void* srcArray;
  size_t srcPitch;
  size_t dstXInBytes, dstY;
  int dstMemoryType;
  void* dstHost;
  CUdeviceptr dstDevice;
  void* dstArray;
  size_t dstPitch;
  size_t WidthInBytes, Height;
};

struct Driver {
  void* handle = nullptr;
  CudaDriverInfo info;
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*pointer_get_attribute)(void*, int, CUdeviceptr) = nullptr;
  CUresult (*memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*memcpy_2d_async)(const Memcpy2D*, CUstream) = nullptr;
  CUresult (*memset_d8_async)(CUdeviceptr, unsigned char, size_t, CUstream) = nullptr;
  CUresult (*memset_d2d8_async)(CUdeviceptr, size_t, unsigned char, size_t, size_t, CUstream) = nullptr;
  // the lanes: side streams the copies are spread over, joined to the caller's stream by events
  CUresult (*stream_create)(CUstream*, unsigned) = nullptr;
  CUresult (*event_create)(CUevent*, unsigned) = nullptr;
  CUresult (*event_record)(CUevent, CUstream) = nullptr;
  CUresult (*stream_wait_event)(CUstream, CUevent, unsigned) = nullptr;
  // the batched copy kernel (csrc/kernels/copy_batch.cu, embedded where nvcc built it)
  CUresult (*module_load_data)(CUmodule*, const void*) = nullptr;
  CUresult (*module_get_function)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            CUstream, void**, void**) = nullptr;
  bool modules = false;  // the three calls above were found
  std::once_flag initialized;

  template <typename F>
  bool find(F* fn, const char* name) {
    *fn = reinterpret_cast<F>(dlsym(handle, name));
    return *fn != nullptr;
  }

  void load() {
    // a driver already in the process (torch's CUDA build maps it) first, then a fresh load
    const char* names[] = {"libcuda.so.1", "libcuda.so"};
    for (int pass = 0; pass < 2 && handle == nullptr; ++pass) {
      for (const char* name : names) {
        handle = dlopen(name, pass == 0 ? (RTLD_NOW | RTLD_NOLOAD) : (RTLD_NOW | RTLD_LOCAL));
        if (handle != nullptr) {
          info.library = name;
          break;
        }
      }
    }
    if (handle == nullptr) {
      info.error = "no CUDA driver (libcuda.so.1 not found)";
      return;
    }
    // the versioned names are what cuda.h maps the plain calls to in CUDA 12
    bool ok = find(&init, "cuInit") && find(&get_error_string, "cuGetErrorString") &&
              find(&ctx_get_current, "cuCtxGetCurrent") && find(&ctx_set_current, "cuCtxSetCurrent") &&
              find(&pointer_get_attribute, "cuPointerGetAttribute") && find(&memcpy_async, "cuMemcpyAsync") &&
              find(&memcpy_2d_async, "cuMemcpy2DAsync_v2") && find(&memset_d8_async, "cuMemsetD8Async") &&
              find(&memset_d2d8_async, "cuMemsetD2D8Async");
    if (!ok) {
      info.error = "the CUDA driver " + info.library + " lacks a function the copy programs use";
      handle = nullptr;
      return;
    }
    modules = find(&module_load_data, "cuModuleLoadData") && find(&module_get_function, "cuModuleGetFunction") &&
              find(&launch_kernel, "cuLaunchKernel");
#ifdef P2PW_HAVE_COPY_KERNEL
    info.kernel = modules;
#endif
    info.lanes = find(&stream_create, "cuStreamCreate") && find(&event_create, "cuEventCreate") &&
                 find(&event_record, "cuEventRecord") && find(&stream_wait_event, "cuStreamWaitEvent");
    info.loaded = true;
  }

  std::string error(CUresult r, const char* call) const {
    const char* text = nullptr;
    if (get_error_string == nullptr || get_error_string(r, &text) != kCudaSuccess || text == nullptr) text = "unknown";
    return std::string(call) + " failed: " + text + " (CUresult " + std::to_string(r) + ")";
  }
};

Driver& driver() {
  static Driver d;
  std::call_once(d.initialized, [] { d.load(); });
  return d;
}

// Makes the context of the slot's allocation current on this thread for the call (a thread that
// never touched CUDA has none; torch's device guard may have left another device's), then puts
// back what was current.
class ContextScope {
 public:
  ContextScope(Driver& d, uint64_t slot) : d_(d) {
    CUresult r = d_.ctx_get_current(&previous_);
    if (r == kCudaNotInitialized) {
      d_.init(0);
      r = d_.ctx_get_current(&previous_);
    }
    if (r != kCudaSuccess) {
      status_ = Status(Code::kDeviceError, d_.error(r, "cuCtxGetCurrent"));
      return;
    }
    CUcontext owner = nullptr;
    // memory of the virtual memory API may name no context: then the current one stays
    if (d_.pointer_get_attribute(&owner, kPointerAttributeContext, slot) == kCudaSuccess && owner != nullptr &&
        owner != previous_) {
      r = d_.ctx_set_current(owner);
      if (r != kCudaSuccess) {
        status_ = Status(Code::kDeviceError, d_.error(r, "cuCtxSetCurrent"));
        return;
      }
      switched_ = true;
    } else if (previous_ == nullptr) {
      status_ = Status(Code::kDeviceError, "no CUDA context is current and the slot's memory names none");
    }
  }
  ~ContextScope() {
    if (switched_) d_.ctx_set_current(previous_);
  }
  const Status& status() const { return status_; }

 private:
  Driver& d_;
  CUcontext previous_ = nullptr;
  bool switched_ = false;
  Status status_;
};

}  // namespace

CudaDriverInfo cuda_driver_info() { return driver().info; }

namespace {

// The side streams of one context (made on first use, kept for the process) and their events.
struct LaneSet {
  CUcontext context = nullptr;
  std::mutex mu;  // held while a program is enqueued: the events are reused
  CUevent start = nullptr;
  std::vector<CUstream> streams;
  std::vector<CUevent> done;
  CUfunction copy_kernel = nullptr;  // loaded into this context on first use
  std::string kernel_error;          // why it could not be (then not tried again)
  // other embedded kernels (launch_embedded_kernel), by image and name: the function, or why not
  std::map<std::pair<const void*, std::string>, std::pair<CUfunction, std::string>> functions;
};

#ifdef P2PW_HAVE_COPY_KERNEL
// The host's view of copy_batch.cu's Batch (the kernel's parameter): keep the two in step.
constexpr int kKernelEntries = 64;
constexpr uint64_t kKernelChunkBytes = 64 << 10;
constexpr unsigned kKernelThreads = 256;
struct KernelEntry {
  uint64_t dst, src;
  int64_t dst_pitch, src_pitch;
  uint64_t units_per_row, units;
  uint32_t first_chunk, width;
};
struct KernelBatch {
  uint32_t count = 0, pad = 0;
  KernelEntry entries[kKernelEntries];
};
static_assert(sizeof(KernelEntry) == 56 && sizeof(KernelBatch) == 8 + 56 * kKernelEntries, "copy_batch.cu layout");

CUfunction copy_kernel(Driver& d, LaneSet& set) {
  if (set.copy_kernel != nullptr || !set.kernel_error.empty()) return set.copy_kernel;
  CUmodule module = nullptr;
  CUresult r = d.module_load_data(&module, p2pw_copy_batch_fatbin);
  if (r == kCudaSuccess) r = d.module_get_function(&set.copy_kernel, module, "p2pw_copy_batch");
  if (r != kCudaSuccess) {
    set.copy_kernel = nullptr;
    set.kernel_error = d.error(r, "loading the batched copy kernel");
  }
  return set.copy_kernel;
}

uint32_t unit_width(uint64_t dst, uint64_t src, const Copy& c) {
  uint64_t bits = dst | src | static_cast<uint64_t>(c.row_bytes);
  if (c.rows > 1) bits |= static_cast<uint64_t>(c.dst_pitch) | static_cast<uint64_t>(c.src_pitch < 0 ? -c.src_pitch : c.src_pitch);
  for (uint32_t w : {16u, 8u, 4u, 2u})
    if (bits % w == 0) return w;
  return 1;
}

// The whole program as launches of the batched kernel on `stream`, kKernelEntries copies each.
Status run_kernel_program(Driver& d, CUfunction fn, const int64_t* program, size_t count, uint64_t slot,
                          const std::vector<CopyInput>& inputs, CUstream stream, int64_t* made) {
  KernelBatch batch;
  uint64_t chunks = 0;
  auto launch = [&]() -> CUresult {
    if (batch.count == 0) return kCudaSuccess;
    void* args[] = {&batch};
    ++*made;
    CUresult r = d.launch_kernel(fn, static_cast<unsigned>(chunks), 1, 1, kKernelThreads, 1, 1, 0, stream, args, nullptr);
    batch.count = 0;
    chunks = 0;
    return r;
  };
  for (size_t i = 0; i < count; ++i) {
    const Copy c = at(program, i);
    const uint64_t dst = slot + static_cast<uint64_t>(c.dst);
    const uint64_t src = c.input < 0 ? 0 : inputs[c.input].address + static_cast<uint64_t>(c.src);
    const uint32_t w = unit_width(dst, src, c);
    const uint64_t per_chunk = kKernelChunkBytes / w;
    const uint64_t units = static_cast<uint64_t>(c.row_bytes / w) * static_cast<uint64_t>(c.rows);
    const uint64_t n_chunks = (units + per_chunk - 1) / per_chunk;
    if (batch.count == kKernelEntries || chunks + n_chunks > (uint64_t(1) << 30)) {
      CUresult r = launch();
      if (r != kCudaSuccess) return Status(Code::kDeviceError, where(i) + ": " + d.error(r, "cuLaunchKernel"));
    }
    KernelEntry& e = batch.entries[batch.count++];
    e.dst = dst;
    e.src = src;
    e.dst_pitch = c.dst_pitch;
    e.src_pitch = c.input < 0 ? 0 : c.src_pitch;
    e.units_per_row = static_cast<uint64_t>(c.row_bytes / w);
    e.units = units;
    e.first_chunk = static_cast<uint32_t>(chunks);
    e.width = w;
    chunks += n_chunks;
  }
  CUresult r = launch();
  if (r != kCudaSuccess) return Status(Code::kDeviceError, d.error(r, "cuLaunchKernel"));
  return Status::Ok();
}
#endif

// The current context's lanes, grown to `want` streams where the driver allows (the caller holds
// set->mu); nullptr when no context is current.
LaneSet* lane_set(Driver& d) {
  static std::mutex sets_mu;
  static std::vector<std::unique_ptr<LaneSet>> sets;
  CUcontext context = nullptr;
  if (d.ctx_get_current(&context) != kCudaSuccess || context == nullptr) return nullptr;
  std::lock_guard<std::mutex> lock(sets_mu);
  for (auto& set : sets)
    if (set->context == context) return set.get();
  sets.push_back(std::make_unique<LaneSet>());
  sets.back()->context = context;
  return sets.back().get();
}

int grow_lanes(Driver& d, LaneSet& set, int want) {
  if (set.start == nullptr && d.event_create(&set.start, kEventDisableTiming) != kCudaSuccess) {
    set.start = nullptr;
    return 1;
  }
  while (static_cast<int>(set.streams.size()) < want) {
    CUstream st = nullptr;
    CUevent ev = nullptr;
    if (d.stream_create(&st, kStreamNonBlocking) != kCudaSuccess) break;
    if (d.event_create(&ev, kEventDisableTiming) != kCudaSuccess) break;  // the stream stays unused
    set.streams.push_back(st);
    set.done.push_back(ev);
  }
  return std::min<int>(want, static_cast<int>(set.streams.size()));
}

}  // namespace

Status run_device_program(const int64_t* program, size_t count, uint64_t slot, uint64_t slot_bytes,
                          const std::vector<CopyInput>& inputs, uint64_t stream_handle, CopyMode mode,
                          int64_t* calls, int lanes) {
  if (calls) *calls = 0;
  Driver& d = driver();
  if (!d.info.loaded) return Status(Code::kNotFound, d.info.error);
  if (slot == 0 && count > 0) return Status(Code::kInvalidArgument, "copy program has no slot");
  if (!range_fits(slot, slot_bytes))
    return Status(Code::kInvalidArgument, "a slot of " + std::to_string(slot_bytes) + " bytes runs past the end of the address space");
  Status s = check_program(program, count, slot_bytes, inputs);
  if (!s.ok() || count == 0) return s;
  ContextScope context(d, slot);
  if (!context.status().ok()) return context.status();
  CUstream stream = reinterpret_cast<CUstream>(stream_handle);
  int64_t made = 0;

#ifdef P2PW_HAVE_COPY_KERNEL
  if (mode == CopyMode::kKernel && d.info.kernel) {
    LaneSet* kset = lane_set(d);
    if (kset == nullptr) return Status(Code::kDeviceError, "no CUDA context for the batched copy kernel");
    std::lock_guard<std::mutex> lock(kset->mu);
    CUfunction fn = copy_kernel(d, *kset);
    if (fn == nullptr) return Status(Code::kDeviceError, kset->kernel_error);
    s = run_kernel_program(d, fn, program, count, slot, inputs, stream, &made);
    if (calls) *calls = made;
    return s;
  }
#endif
  (void)mode;  // kEach, or kKernel where the module was built without the kernel: one call per copy

  // the streams the copies go to: the caller's, or lanes forked from it (joined back below)
  std::vector<CUstream> targets{stream};
  LaneSet* set = nullptr;
  std::unique_lock<std::mutex> hold;
  const int want = std::min<int>(std::max(1, std::min(lanes, kMaxCopyLanes)), static_cast<int>(count));
  if (want > 1 && d.info.lanes && (set = lane_set(d)) != nullptr) {
    hold = std::unique_lock<std::mutex>(set->mu);
    const int have = grow_lanes(d, *set, want);
    if (have > 1) {
      ++made;
      CUresult r = d.event_record(set->start, stream);
      for (int k = 0; k < have && r == kCudaSuccess; ++k, ++made) r = d.stream_wait_event(set->streams[k], set->start, 0);
      if (r != kCudaSuccess) {
        if (calls) *calls = made;
        return Status(Code::kDeviceError, d.error(r, "forking the copy lanes"));  // nothing enqueued yet
      }
      targets.assign(set->streams.begin(), set->streams.begin() + have);
    }
  }
  const size_t n_lanes = targets.size();
  // the caller's stream waits for every lane: on success and on failure (nothing of the call may
  // still run on a lane when the caller's next work starts, e.g. the fallback rewriting the group)
  auto join = [&]() -> CUresult {
    CUresult first = kCudaSuccess;
    if (n_lanes < 2) return first;
    for (size_t k = 0; k < n_lanes; ++k) {
      made += 2;
      CUresult r = d.event_record(set->done[k], targets[k]);
      if (r == kCudaSuccess) r = d.stream_wait_event(stream, set->done[k], 0);
      if (r != kCudaSuccess && first == kCudaSuccess) first = r;
    }
    return first;
  };
  auto fail = [&](const std::string& what) -> Status {
    join();
    if (calls) *calls = made;
    return Status(Code::kDeviceError, what);
  };

  std::vector<uint64_t> load(n_lanes, 0);
  auto pick = [&](uint64_t bytes) -> size_t {  // the least loaded lane, by bytes
    size_t best = 0;
    for (size_t k = 1; k < n_lanes; ++k)
      if (load[k] < load[best]) best = k;
    load[best] += bytes;
    return best;
  };
  auto one_d = [&](CUstream st, CUdeviceptr to, CUdeviceptr from, size_t n) -> CUresult {
    ++made;
    return d.memcpy_async(to, from, n, st);
  };
  for (size_t i = 0; i < count; ++i) {
    const Copy c = at(program, i);
    const size_t lane = pick(c.bytes());
    CUstream st = targets[lane];
    const CUdeviceptr to = slot + static_cast<uint64_t>(c.dst);
    CUresult r = kCudaSuccess;
    const char* call = "";
    if (c.input < 0) {
      ++made;
      if (c.rows == 1) {
        call = "cuMemsetD8Async";
        r = d.memset_d8_async(to, 0, static_cast<size_t>(c.row_bytes), st);
      } else if (c.dst_pitch <= kMaxPitch) {
        call = "cuMemsetD2D8Async";
        r = d.memset_d2d8_async(to, static_cast<size_t>(c.dst_pitch), 0, static_cast<size_t>(c.row_bytes),
                                static_cast<size_t>(c.rows), st);
      } else {
        call = "cuMemsetD8Async";
        for (int64_t row = 0; row < c.rows && r == kCudaSuccess; ++row, ++made)
          r = d.memset_d8_async(to + static_cast<uint64_t>(row * c.dst_pitch), 0, static_cast<size_t>(c.row_bytes), st);
      }
    } else {
      const CUdeviceptr from = inputs[c.input].address + static_cast<uint64_t>(c.src);
      call = "cuMemcpyAsync";
      if (c.rows == 1) {
        r = one_d(st, to, from, static_cast<size_t>(c.row_bytes));
      } else if (c.src_pitch >= c.row_bytes && c.src_pitch <= kMaxPitch && c.dst_pitch <= kMaxPitch) {
        Memcpy2D m{};
        m.srcMemoryType = kMemoryTypeUnified;
        m.srcDevice = from;
        m.srcPitch = static_cast<size_t>(c.src_pitch);
        m.dstMemoryType = kMemoryTypeUnified;
        m.dstDevice = to;
        m.dstPitch = static_cast<size_t>(c.dst_pitch);
        m.WidthInBytes = static_cast<size_t>(c.row_bytes);
        m.Height = static_cast<size_t>(c.rows);
        call = "cuMemcpy2DAsync";
        ++made;
        r = d.memcpy_2d_async(&m, st);
      } else {  // a source read backwards or repeated, or pitches past the 2-D limit: row by row
        for (int64_t row = 0; row < c.rows && r == kCudaSuccess; ++row)
          r = one_d(st, to + static_cast<uint64_t>(row * c.dst_pitch),
                    static_cast<CUdeviceptr>(static_cast<int64_t>(from) + row * c.src_pitch),
                    static_cast<size_t>(c.row_bytes));
      }
    }
    if (r != kCudaSuccess) return fail(where(i) + ": " + d.error(r, call));
  }
  CUresult r = join();
  if (calls) *calls = made;
  if (r != kCudaSuccess) return Status(Code::kDeviceError, d.error(r, "joining the copy lanes"));
  return Status::Ok();
}


Status launch_embedded_kernel(const void* image, const char* name, uint64_t anchor, unsigned grid, unsigned block,
                              void** args, uint64_t stream_handle) {
  Driver& d = driver();
  if (!d.info.loaded) return Status(Code::kNotFound, d.info.error);
  if (!d.modules) return Status(Code::kNotFound, "the CUDA driver " + d.info.library + " cannot load modules");
  if (grid == 0) return Status::Ok();
  ContextScope context(d, anchor);
  if (!context.status().ok()) return context.status();
  LaneSet* set = lane_set(d);
  if (set == nullptr) return Status(Code::kDeviceError, std::string("no CUDA context for ") + name);
  CUfunction fn = nullptr;
  {
    std::lock_guard<std::mutex> lock(set->mu);
    auto key = std::make_pair(image, std::string(name));
    auto it = set->functions.find(key);
    if (it == set->functions.end()) {
      CUmodule module = nullptr;
      CUresult r = d.module_load_data(&module, image);
      CUfunction f = nullptr;
      if (r == kCudaSuccess) r = d.module_get_function(&f, module, name);
      std::string why = r == kCudaSuccess ? std::string() : d.error(r, (std::string("loading ") + name).c_str());
      it = set->functions.emplace(key, std::make_pair(f, why)).first;
    }
    if (it->second.first == nullptr) return Status(Code::kDeviceError, it->second.second);
    fn = it->second.first;
  }
  CUresult r = d.launch_kernel(fn, grid, 1, 1, block, 1, 1, 0, reinterpret_cast<CUstream>(stream_handle), args, nullptr);
  if (r != kCudaSuccess) return Status(Code::kDeviceError, d.error(r, (std::string("launching ") + name).c_str()));
  return Status::Ok();
}

}  // namespace p2pw
