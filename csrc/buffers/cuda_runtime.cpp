#include "buffers/cuda_runtime.h"

#include <dlfcn.h>

#include <cstdlib>

namespace p2pw {

namespace {
constexpr unsigned kHostRegisterPortable = 0x01;
constexpr int kNoRuntime = -1000;
}  // namespace

CudaRuntime& CudaRuntime::get() {
  static CudaRuntime instance;
  return instance;
}

CudaRuntime::CudaRuntime() {
  // P2PW_CUDA_RUNTIME names the library explicitly; otherwise try the common sonames. A runtime
  // already in the process (torch's CUDA build maps one) is used whatever its path: loading a
  // second copy by another path would give two runtimes with separate state. So every candidate is
  // first looked for among the loaded libraries (RTLD_NOLOAD; a soname matches a library loaded
  // from any path), and only when none is loaded is one loaded, the named one first.
  const char* forced = std::getenv("P2PW_CUDA_RUNTIME");
  const char* candidates[] = {forced, "libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"};
  for (int pass = 0; pass < 2 && handle_ == nullptr; ++pass) {
    for (const char* name : candidates) {
      if (name == nullptr || *name == '\0') continue;
      void* h = dlopen(name, pass == 0 ? (RTLD_NOW | RTLD_NOLOAD) : (RTLD_NOW | RTLD_LOCAL));
      if (h != nullptr) {
        handle_ = h;
        library_ = name;
        break;
      }
    }
  }
  if (handle_ == nullptr) return;
  get_device_count_ = reinterpret_cast<int (*)(int*)>(dlsym(handle_, "cudaGetDeviceCount"));
  host_register_ = reinterpret_cast<int (*)(void*, size_t, unsigned)>(dlsym(handle_, "cudaHostRegister"));
  host_unregister_ = reinterpret_cast<int (*)(void*)>(dlsym(handle_, "cudaHostUnregister"));
  get_error_string_ = reinterpret_cast<const char* (*)(int)>(dlsym(handle_, "cudaGetErrorString"));
  if (!get_device_count_ || !host_register_ || !host_unregister_) {
    handle_ = nullptr;  // an unusable runtime counts as none
  }
}

int CudaRuntime::device_count() const {
  if (!get_device_count_) return 0;
  int n = 0;
  return get_device_count_(&n) == 0 ? n : 0;
}

int CudaRuntime::host_register(void* ptr, size_t bytes) const {
  return host_register_ ? host_register_(ptr, bytes, kHostRegisterPortable) : kNoRuntime;
}
int CudaRuntime::host_unregister(void* ptr) const {
  return host_unregister_ ? host_unregister_(ptr) : kNoRuntime;
}
std::string CudaRuntime::error_string(int err) const {
  if (err == kNoRuntime) return "no CUDA runtime";
  if (get_error_string_) return get_error_string_(err);
  return "cuda error " + std::to_string(err);
}

}  // namespace p2pw
