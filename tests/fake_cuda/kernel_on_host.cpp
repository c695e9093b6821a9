// csrc/kernels/copy_batch.cu's kernel compiled for the host: the CUDA qualifiers defined away,
// blockIdx/threadIdx/blockDim as globals the launch loops over (tests/fake_cuda/fake_driver.cpp).
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __grid_constant__
struct HostDim { unsigned x; };
static HostDim blockIdx, threadIdx, blockDim;
struct uint4 { unsigned x, y, z, w; };
#include "../../csrc/kernels/copy_batch.cu"

extern "C" long kernel_on_host(const void* param, unsigned grid, unsigned block) {
  const Batch* batch = static_cast<const Batch*>(param);
  blockDim.x = block;
  for (blockIdx.x = 0; blockIdx.x < grid; ++blockIdx.x)
    for (threadIdx.x = 0; threadIdx.x < block; ++threadIdx.x) p2pw_copy_batch(*batch);
  return batch->count;
}
