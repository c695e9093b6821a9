#!/usr/bin/env bash
# Run on the GPU machine from the repository root (one call): build the extension there, check the
# carried bundles, print doctor, run the GPU benchmark. Carry: .carry/gpu-sglang .carry/gpu-nixl .carry/gpu-mooncake
# DEVICE_TESTS="tests/a.py tests/b.py": run those tests on the GPU first; the benchmark runs only when they pass.
set -uo pipefail
SECTIONS=${1:-bandwidth,production,writes,update}
source scripts/gpu_env.sh
# sglang's CUDA import path needs sgl_kernel/cutlass (not carried) and initializes CUDA in the
# receiver's fork launcher: import it as on a CPU host (the byte-exact path) and spawn rank processes.
export P2PW_SGLANG_IMPORT_AS_CPU=1 P2PW_RECEIVER_LAUNCH=spawn
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m pip wheel -q --no-build-isolation --no-deps --no-index . -w /tmp/p2pw-wheel >/tmp/build.log 2>&1 \
  || { tail -30 /tmp/build.log; exit 1; }
python3 -m pip install -q --no-deps --no-index --target /tmp/p2pw-site /tmp/p2pw-wheel/p2pweights-*.whl
export PYTHONPATH=/tmp/p2pw-site:${PYTHONPATH:-}
export PATH=/tmp/p2pw-site/bin:$PATH
p2pw_gpu_check || echo "gpu check reported a problem"
python3 -m p2pweights doctor
if [ -n "${DEVICE_TESTS:-}" ]; then
  python3 -m pytest -q -p no:cacheprovider $DEVICE_TESTS 2>&1 | tail -25
  [ "${PIPESTATUS[0]}" = 0 ] || { echo "device tests failed: no benchmark"; exit 1; }
fi
python3 benchmarks/gpu/bench_gpu.py --sections "$SECTIONS" --out "${OUT:-.}/gpu_results.json"
# DEVICE_AFTER="cmd": run after the benchmark with the same wheel and environment (another benchmark)
if [ -n "${DEVICE_AFTER:-}" ]; then eval "$DEVICE_AFTER"; fi
