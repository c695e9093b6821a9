#!/usr/bin/env bash
# One call on a multi-GPU kind (nvidia-h200-x2/-x4/-x8), from the repository root:
#   run(kind="nvidia-h200-x4", carry=[".carry/gpu-sglang", ".carry/gpu-nixl", ".carry/gpu-mooncake"],
#       command="bash benchmarks/gpu/run_multi_gpu.sh")
set -uo pipefail
source scripts/gpu_env.sh
export P2PW_SGLANG_IMPORT_AS_CPU=1 P2PW_RECEIVER_LAUNCH=spawn NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
python3 -m pip wheel -q --no-build-isolation --no-deps --no-index . -w /tmp/p2pw-wheel >/tmp/build.log 2>&1 \
  || { tail -30 /tmp/build.log; exit 1; }
python3 -m pip install -q --no-deps --no-index --target /tmp/p2pw-site /tmp/p2pw-wheel/p2pweights-*.whl
export PYTHONPATH=/tmp/p2pw-site:${PYTHONPATH:-}
python3 benchmarks/gpu/bench_multi_gpu.py "$@"
