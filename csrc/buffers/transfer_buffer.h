// Transfer buffers: one allocation per process, cut into equal slots that the loaders fill and the
// writer's threads read. Host memory is page-aligned and pinned (CUDA host registration when a CUDA
// runtime and device exist, else mlock, else unpinned with one warning). GPU memory is owned by the
// caller (e.g. a torch tensor) and wrapped, so the core never links torch.
//
// Users hold the memory open: a slot view (a Python memoryview handed to numpy or torch) and a
// batch of writes that may still read a slot each count as one. close() while any is alive only
// marks the buffer closed (no new views or writes); the memory is freed when the last user ends,
// so neither a live tensor nor a write in flight ever reads freed memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "status.h"

namespace p2pw {

enum class PinMode { kNone, kMlock, kCudaHostRegister, kDevice };
const char* pin_mode_name(PinMode m);

class TransferBuffer {
 public:
  static constexpr size_t kAlignment = 2 * 1024 * 1024;  // huge-page friendly, and a NIC MR unit

  // Allocates num_slots × slot_bytes rounded up to kAlignment of host memory and pins it; a size
  // that does not fit in 64 bits is kInvalidArgument (never a wrapped, smaller allocation).
  // pin: "auto" (cuda, then mlock), "cuda", "mlock" or "none". Pinning that cannot be had leaves the
  // memory unpinned with a warning (pin_warning), except "cuda" refused by a runtime that has a
  // device: kDeviceError.
  static Status allocate_host(size_t slot_bytes, int num_slots, const std::string& pin,
                              std::unique_ptr<TransferBuffer>* out);
  // Wraps memory owned by someone else (GPU slots from a torch allocation, a receiver's region);
  // slots that would run past 2^64 are kInvalidArgument.
  static Status wrap(uint64_t addr, size_t slot_bytes, int num_slots, const std::string& location,
                     std::unique_ptr<TransferBuffer>* out);

  ~TransferBuffer();
  TransferBuffer(const TransferBuffer&) = delete;
  TransferBuffer& operator=(const TransferBuffer&) = delete;

  // Unpins and frees (host) or forgets (wrapped) once no user is left; safe twice.
  void close();
  bool closed() const;    // close() was called: no new views or writes
  bool released() const;  // the memory itself is gone (closed and no user left)
  // A user that reads or writes the memory: false (and nothing counted) once closed.
  bool begin_use(int n = 1);
  void end_use(int n = 1);  // the last user of a closed buffer frees it
  int users() const;
  // The one writer whose slots these are: a second writer over the same buffer would hand out, and
  // write from, slots the first one acquired. claim_writer() is false while another writer holds it.
  bool claim_writer();
  void release_writer();

  uint8_t* base() const { return base_; }
  uint64_t address() const { return reinterpret_cast<uint64_t>(base_); }
  size_t slot_bytes() const { return slot_bytes_; }
  int num_slots() const { return num_slots_; }
  size_t total_bytes() const { return slot_bytes_ * static_cast<size_t>(num_slots_); }
  uint8_t* slot(int i) const { return base_ + slot_bytes_ * static_cast<size_t>(i); }
  PinMode pin_mode() const { return pin_mode_; }
  const std::string& location() const { return location_; }  // "cpu" or "cuda:N"
  const std::string& pin_warning() const { return pin_warning_; }
  bool owns_memory() const { return owned_; }

 private:
  TransferBuffer() = default;
  void release_memory();  // mu_ held
  mutable std::mutex mu_;
  bool close_requested_ = false;
  bool has_writer_ = false;
  int users_ = 0;
  uint8_t* base_ = nullptr;
  size_t slot_bytes_ = 0;
  int num_slots_ = 0;
  PinMode pin_mode_ = PinMode::kNone;
  std::string location_ = "cpu";
  std::string pin_warning_;
  bool owned_ = false;
};

}  // namespace p2pw
