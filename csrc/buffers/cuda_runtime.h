// The CUDA runtime, found at run time with dlopen: the wheel is built without a CUDA toolkit and
// serves machines with and without GPUs.
#pragma once

#include <cstddef>
#include <string>

namespace p2pw {

class CudaRuntime {
 public:
  // The process-wide instance; loads libcudart on first use.
  static CudaRuntime& get();

  bool loaded() const { return handle_ != nullptr; }
  const std::string& library() const { return library_; }
  int device_count() const;  // 0 when no runtime or no device

  // cudaHostRegister / cudaHostUnregister (portable flag). Return 0 on success (cudaSuccess).
  int host_register(void* ptr, size_t bytes) const;
  int host_unregister(void* ptr) const;
  std::string error_string(int err) const;

 private:
  CudaRuntime();
  void* handle_ = nullptr;
  std::string library_;
  int (*get_device_count_)(int*) = nullptr;
  int (*host_register_)(void*, size_t, unsigned) = nullptr;
  int (*host_unregister_)(void*) = nullptr;
  const char* (*get_error_string_)(int) = nullptr;
};

}  // namespace p2pw
