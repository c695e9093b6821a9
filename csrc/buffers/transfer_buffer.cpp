#include "buffers/transfer_buffer.h"

#include <sys/mman.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

#include "buffers/cuda_runtime.h"
#include "checked_math.h"

namespace p2pw {

const char* pin_mode_name(PinMode m) {
  switch (m) {
    case PinMode::kNone: return "none";
    case PinMode::kMlock: return "mlock";
    case PinMode::kCudaHostRegister: return "cuda_host_register";
    case PinMode::kDevice: return "device";
  }
  return "unknown";
}

Status TransferBuffer::allocate_host(size_t slot_bytes, int num_slots, const std::string& pin,
                                     std::unique_ptr<TransferBuffer>* out) {
  if (slot_bytes == 0) return Status(Code::kInvalidArgument, "slot size must be positive");
  if (num_slots < 1) return Status(Code::kInvalidArgument, "need at least one slot");
  if (pin != "auto" && pin != "cuda" && pin != "mlock" && pin != "none")
    return Status(Code::kInvalidArgument, "pin must be auto, cuda, mlock or none, not '" + pin + "'");
  uint64_t slot = 0, total = 0;
  if (!checked_round_up(slot_bytes, kAlignment, &slot) || !checked_mul<uint64_t>(slot, num_slots, &total))
    return Status(Code::kInvalidArgument, std::to_string(num_slots) + " slots of " + std::to_string(slot_bytes) +
                                              " bytes do not fit in a 64-bit size; refusing to allocate");
  // mmap gives page-aligned, zero-filled memory and lets the kernel back it lazily.
  void* p = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    return Status(Code::kInvalidArgument, "cannot allocate " + std::to_string(total) +
                                              " bytes of transfer buffer: " + std::strerror(errno));
  madvise(p, total, MADV_HUGEPAGE);
  std::unique_ptr<TransferBuffer> b(new TransferBuffer());  // the constructor is private
  b->base_ = static_cast<uint8_t*>(p);
  b->slot_bytes_ = slot;
  b->num_slots_ = num_slots;
  b->owned_ = true;

  std::string why;
  bool pinned = false;
  if (pin == "auto" || pin == "cuda") {
    CudaRuntime& cuda = CudaRuntime::get();
    if (cuda.loaded() && cuda.device_count() > 0) {
      int err = cuda.host_register(p, total);
      if (err == 0) {
        b->pin_mode_ = PinMode::kCudaHostRegister;
        pinned = true;
      } else if (pin == "cuda") {  // asked for by name, and the runtime failed: a device error, not a warning
        return Status(Code::kDeviceError, "cudaHostRegister of " + std::to_string(total) +
                                              " bytes failed: " + cuda.error_string(err));  // b unmaps
      } else {
        why = "cudaHostRegister failed: " + cuda.error_string(err);
      }
    } else {
      why = cuda.loaded() ? "CUDA runtime has no device" : "no CUDA runtime";
    }
  }
  if (!pinned && (pin == "auto" || pin == "mlock")) {
    if (mlock(p, total) == 0) {
      b->pin_mode_ = PinMode::kMlock;
      pinned = true;
    } else {
      why += std::string(why.empty() ? "" : "; ") + "mlock of " + std::to_string(total) +
             " bytes failed: " + std::strerror(errno) + " (raise `ulimit -l` or run with CAP_IPC_LOCK)";
    }
  }
  if (!pinned && pin != "none") {
    b->pin_warning_ = "transfer buffer is not pinned (" + why +
                      "); writes still work but the transport may bounce through its own copies";
  }
  *out = std::move(b);
  return Status::Ok();
}

Status TransferBuffer::wrap(uint64_t addr, size_t slot_bytes, int num_slots, const std::string& location,
                            std::unique_ptr<TransferBuffer>* out) {
  if (addr == 0) return Status(Code::kInvalidArgument, "cannot wrap a null address");
  if (slot_bytes == 0 || num_slots < 1)
    return Status(Code::kInvalidArgument, "slot size and slot count must be positive");
  uint64_t total = 0;
  if (!checked_mul<uint64_t>(slot_bytes, num_slots, &total) || !range_fits(addr, total))
    return Status(Code::kInvalidArgument, std::to_string(num_slots) + " slots of " + std::to_string(slot_bytes) +
                                              " bytes at 0x" + [&] {
                                                char b[32];
                                                snprintf(b, sizeof b, "%llx", static_cast<unsigned long long>(addr));
                                                return std::string(b);
                                              }() + " run past the end of the address space; refusing to wrap them");
  std::unique_ptr<TransferBuffer> b(new TransferBuffer());  // the constructor is private
  b->base_ = reinterpret_cast<uint8_t*>(addr);
  b->slot_bytes_ = slot_bytes;
  b->num_slots_ = num_slots;
  b->location_ = location;
  b->pin_mode_ = location.rfind("cuda", 0) == 0 ? PinMode::kDevice : PinMode::kNone;
  b->owned_ = false;
  *out = std::move(b);
  return Status::Ok();
}

void TransferBuffer::close() {
  std::lock_guard<std::mutex> lk(mu_);
  close_requested_ = true;
  if (users_ == 0) release_memory();
}

bool TransferBuffer::closed() const {
  std::lock_guard<std::mutex> lk(mu_);
  return close_requested_ || base_ == nullptr;
}

bool TransferBuffer::released() const {
  std::lock_guard<std::mutex> lk(mu_);
  return base_ == nullptr;
}

int TransferBuffer::users() const {
  std::lock_guard<std::mutex> lk(mu_);
  return users_;
}

bool TransferBuffer::begin_use(int n) {
  std::lock_guard<std::mutex> lk(mu_);
  if (close_requested_ || base_ == nullptr) return false;
  users_ += n;
  return true;
}

bool TransferBuffer::claim_writer() {
  std::lock_guard<std::mutex> lk(mu_);
  if (has_writer_) return false;
  has_writer_ = true;
  return true;
}

void TransferBuffer::release_writer() {
  std::lock_guard<std::mutex> lk(mu_);
  has_writer_ = false;
}

void TransferBuffer::end_use(int n) {
  std::lock_guard<std::mutex> lk(mu_);
  users_ -= n;
  if (users_ <= 0 && close_requested_) release_memory();
}

void TransferBuffer::release_memory() {
  if (base_ == nullptr) return;
  if (owned_) {
    const size_t total = total_bytes();
    if (pin_mode_ == PinMode::kCudaHostRegister) CudaRuntime::get().host_unregister(base_);
    if (pin_mode_ == PinMode::kMlock) munlock(base_, total);
    munmap(base_, total);
  }
  base_ = nullptr;
}

TransferBuffer::~TransferBuffer() {
  std::lock_guard<std::mutex> lk(mu_);
  // A user left at destruction can only be a write the transport could not cancel (abandoned at
  // its deadline, still reading): leaking the memory is safe, unmapping it under that write is not.
  if (users_ == 0) release_memory();
}

}  // namespace p2pw
