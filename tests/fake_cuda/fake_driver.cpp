// A host-memory stand-in for the CUDA driver (libcuda.so.1) for tests/test_copy_kernel_host.py: the
// few driver calls the copy programs make (csrc/buffers/copy_program.cpp), "device" pointers being
// host pointers, and cuLaunchKernel running csrc/kernels/copy_batch.cu's kernel on the host, block by
// block and thread by thread (kernel_on_host.cpp). Declares only what it implements (the ABI of
// cuda.h); it checks the arguments the real driver would refuse.
#include <cstddef>
#include <cstring>

extern "C" {
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void* CUcontext;
typedef void* CUstream;
typedef void* CUevent;
typedef void* CUmodule;
typedef void* CUfunction;
struct Memcpy2D {
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
long kernel_on_host(const void* param, unsigned grid, unsigned block);
}

namespace {
constexpr CUresult kOk = 0, kInvalid = 1, kNotInitialized = 3, kInvalidContext = 201, kNotFound = 500,
                   kLaunchFailed = 719;
CUcontext current = nullptr;
CUcontext const owner = reinterpret_cast<CUcontext>(0x1234);
bool initialized = false;
long counts[7] = {0};  // memcpy, 2d, memset, launches, kernel entries, streams, waits
long next_handle = 0x1000;
int fail_call = -1;  // a counts index whose call fails from now on (fake_fail), as a broken device would
CUresult need_ctx() { return current == owner ? kOk : kInvalidContext; }
CUresult failing(int call) { return call == fail_call ? kLaunchFailed : kOk; }
}  // namespace

extern "C" {
long fake_count(int i) { return counts[i]; }
void fake_fail(int call) { fail_call = call; }
CUresult cuInit(unsigned) { initialized = true; return kOk; }
CUresult cuGetErrorString(CUresult e, const char** s) {
  *s = e == kInvalid ? "invalid argument" : e == kLaunchFailed ? "unspecified launch failure" : "other";
  return kOk;
}
CUresult cuCtxGetCurrent(CUcontext* c) { if (!initialized) return kNotInitialized; *c = current; return kOk; }
CUresult cuCtxSetCurrent(CUcontext c) { current = c; return kOk; }
CUresult cuPointerGetAttribute(void* data, int attribute, CUdeviceptr) {
  if (attribute != 1) return kInvalid;  // CU_POINTER_ATTRIBUTE_CONTEXT
  *static_cast<CUcontext*>(data) = owner;
  return kOk;
}
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream) {
  if (need_ctx()) return need_ctx();
  if (failing(0)) return failing(0);
  ++counts[0];
  std::memcpy(reinterpret_cast<void*>(d), reinterpret_cast<void*>(s), n);
  return kOk;
}
CUresult cuMemcpy2DAsync_v2(const Memcpy2D* m, CUstream) {
  if (need_ctx()) return need_ctx();
  if (m->srcMemoryType != 4 || m->dstMemoryType != 4 || m->srcXInBytes || m->srcY || m->dstXInBytes || m->dstY ||
      m->srcPitch < m->WidthInBytes || m->dstPitch < m->WidthInBytes)
    return kInvalid;
  ++counts[1];
  for (size_t r = 0; r < m->Height; ++r)
    std::memcpy(reinterpret_cast<char*>(m->dstDevice) + r * m->dstPitch,
                reinterpret_cast<char*>(m->srcDevice) + r * m->srcPitch, m->WidthInBytes);
  return kOk;
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream) {
  if (need_ctx()) return need_ctx();
  ++counts[2];
  std::memset(reinterpret_cast<void*>(d), v, n);
  return kOk;
}
CUresult cuMemsetD2D8Async(CUdeviceptr d, size_t pitch, unsigned char v, size_t w, size_t h, CUstream) {
  if (need_ctx()) return need_ctx();
  if (pitch < w) return kInvalid;
  ++counts[2];
  for (size_t r = 0; r < h; ++r) std::memset(reinterpret_cast<char*>(d) + r * pitch, v, w);
  return kOk;
}
CUresult cuStreamCreate(CUstream* s, unsigned flags) {
  if (need_ctx() || flags != 1) return kInvalid;  // CU_STREAM_NON_BLOCKING
  *s = reinterpret_cast<CUstream>(next_handle++);
  ++counts[5];
  return kOk;
}
CUresult cuEventCreate(CUevent* e, unsigned flags) {
  if (flags != 2) return kInvalid;  // CU_EVENT_DISABLE_TIMING
  *e = reinterpret_cast<CUevent>(next_handle++);
  return kOk;
}
CUresult cuEventRecord(CUevent e, CUstream) { return e ? kOk : kInvalid; }
CUresult cuStreamWaitEvent(CUstream, CUevent e, unsigned flags) {
  if (!e || flags) return kInvalid;
  ++counts[6];
  return kOk;
}
CUresult cuModuleLoadData(CUmodule* m, const void* image) {
  if (!image) return kInvalid;
  *m = reinterpret_cast<CUmodule>(next_handle++);
  return kOk;
}
CUresult cuModuleGetFunction(CUfunction* f, CUmodule, const char* name) {
  if (std::strcmp(name, "p2pw_copy_batch") != 0) return kNotFound;
  *f = reinterpret_cast<CUfunction>(next_handle++);
  return kOk;
}
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, CUstream, void** params, void** extra) {
  if (need_ctx() || !f || gx == 0 || gy != 1 || gz != 1 || by != 1 || bz != 1 || bx > 1024 || shared || extra || !params)
    return kInvalid;
  if (failing(3)) return failing(3);
  ++counts[3];
  counts[4] += kernel_on_host(params[0], gx, bx);
  return kOk;
}
}
