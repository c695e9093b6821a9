// A stand-in for the CUDA runtime (libcudart) for tests/test_buffers.py: one device whose host
// registration always fails, as a driver out of resources would. Loaded with P2PW_CUDA_RUNTIME.
#include <cstddef>

extern "C" {
int cudaGetDeviceCount(int* n) { *n = 1; return 0; }
int cudaHostRegister(void*, size_t, unsigned) { return 2; }  // cudaErrorMemoryAllocation
int cudaHostUnregister(void*) { return 0; }
const char* cudaGetErrorString(int e) { return e == 2 ? "out of memory" : "other"; }
}
