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
  // cudaMalloc / cudaFree / cudaMemcpy (kind = cudaMemcpyDefault) for GPU slots.
  int malloc_device(void** ptr, size_t bytes) const;
  int free_device(void* ptr) const;
  int memcpy_default(void* dst, const void* src, size_t bytes) const;
  int set_device(int device) const;
  std::string error_string(int err) const;

 private:
  CudaRuntime();
  void* handle_ = nullptr;
  std::string library_;
  int (*get_device_count_)(int*) = nullptr;
  int (*host_register_)(void*, size_t, unsigned) = nullptr;
  int (*host_unregister_)(void*) = nullptr;
  int (*malloc_)(void**, size_t) = nullptr;
  int (*free_)(void*) = nullptr;
  int (*memcpy_)(void*, const void*, size_t, int) = nullptr;
  int (*set_device_)(int) = nullptr;
  const char* (*get_error_string_)(int) = nullptr;
};

}  // namespace p2pw
