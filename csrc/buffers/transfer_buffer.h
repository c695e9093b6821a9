// Transfer buffers: one allocation per process, cut into equal slots that the loaders fill and the
// writer's threads read. Host memory is page-aligned and pinned (CUDA host registration when a CUDA
// runtime and device exist, else mlock, else unpinned with one warning). GPU memory is owned by the
// caller (e.g. a torch tensor) and wrapped, so the core never links torch.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "status.h"

namespace p2pw {

enum class PinMode { kNone, kMlock, kCudaHostRegister, kDevice };
const char* pin_mode_name(PinMode m);

class TransferBuffer {
 public:
  static constexpr size_t kAlignment = 2 * 1024 * 1024;  // huge-page friendly, and a NIC MR unit

  // Allocates num_slots × round_up(slot_bytes, kAlignment) of host memory and pins it.
  // pin: "auto" (cuda, then mlock), "cuda", "mlock" or "none".
  static Status allocate_host(size_t slot_bytes, int num_slots, const std::string& pin,
                              TransferBuffer** out);
  // Wraps memory owned by someone else (GPU slots from a torch allocation, a receiver's region).
  static Status wrap(uint64_t addr, size_t slot_bytes, int num_slots, const std::string& location,
                     TransferBuffer** out);

  ~TransferBuffer();
  TransferBuffer(const TransferBuffer&) = delete;
  TransferBuffer& operator=(const TransferBuffer&) = delete;

  void close();  // unpins and frees (host) or forgets (wrapped); safe twice
  bool closed() const { return base_ == nullptr; }

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

  static size_t round_up(size_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

 private:
  TransferBuffer() = default;
  uint8_t* base_ = nullptr;
  size_t slot_bytes_ = 0;
  int num_slots_ = 0;
  PinMode pin_mode_ = PinMode::kNone;
  std::string location_ = "cpu";
  std::string pin_warning_;
  bool owned_ = false;
};

}  // namespace p2pw
