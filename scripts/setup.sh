#!/usr/bin/env bash
# One-command setup for p2pweights on a CPU development machine (Debian, Python 3.11).
# Installs the system library Mooncake needs, the Python dependencies (torch CPU build, a minimal
# sglang 0.5.23 for model classes and loaders plus what its server needs to start here, Mooncake and
# NIXL), then builds and installs this package. Safe to run twice.
set -euo pipefail
cd "$(dirname "$0")/.."

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi
if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libibverbs1 >/dev/null
fi

PIP="python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore"

# torch: the CPU build (sglang's own pin would pull a multi-GB CUDA build).
$PIP "torch==2.13.0"
# sglang for its model classes and weight loaders only; its full dependency set needs a GPU stack.
$PIP --no-deps "sglang==0.5.23"
$PIP numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm \
  IPython aiohttp dill einops gguf partial-json-parser "apache-tvm-ffi==0.1.11" \
  "transformers==5.19.0" "sentencepiece==0.2.1" "triton==3.8.0" "compressed-tensors==0.18.0" \
  "openai==2.8.0" fastapi uvicorn
# A real sglang server (python -m sglang.launch_server, the plugin's tests; docs/sglang.md): what its
# HTTP server, scheduler and detokenizer import at start-up beyond the above, and nothing more.
$PIP "uvloop==0.23.0" "setproctitle==1.3.8" "python-multipart==0.0.34" "soundfile==0.13.1" "xgrammar==0.2.7" \
  "jsonschema==4.26.0"
# Transports: Mooncake (CPU build) and NIXL's UCX plugin (import nixl_cu12 directly; the `nixl`
# meta package drags in a CUDA torch).
$PIP mooncake-transfer-engine-non-cuda
$PIP --no-deps nixl-cu12
# vLLM 0.33 for the vLLM replica and backend (docs/vllm.md), installed apart in .vllm_site (pip --target,
# no dependencies: the registry's wheel is a CUDA build and pins another torch). Apart, because vLLM
# needs an openai that sglang's pin refuses, and sglang's CPU kernels take vLLM's (GPU-only) ops
# whenever vLLM imports: the tests put .vllm_site on the path of the vLLM tests' own process only
# (tests/test_vllm_suite.py). What vLLM's modules import beyond the main install, found in a fresh
# virtual environment (cloudpickle: vllm.v1.serial_utils, reached by every vLLM config). The list is
# stamped in .vllm_site: a folder installed from another list gets the packages again.
VLLM_SITE_PACKAGES=("cbor2==6.3.0" "cachetools==8.0.2" "blake3==1.0.11" "py-cpuinfo==9.0.0" "ijson==3.6.0"
  "python-json-logger==4.2.0" "oss-harmony==0.0.11" "prometheus_client==0.26.0"
  "prometheus-fastapi-instrumentator==8.1.0" "openai==2.25.0" "llguidance==1.7.6" "watchfiles==1.3.0"
  "cloudpickle==3.1.3")
if [ ! -f .vllm_site/vllm/__init__.py ]; then
  $PIP --no-deps --target .vllm_site "vllm==0.33.0"
fi
if [ "$(cat .vllm_site/.p2pweights-packages 2>/dev/null)" != "${VLLM_SITE_PACKAGES[*]}" ]; then
  $PIP --no-deps --upgrade --target .vllm_site "${VLLM_SITE_PACKAGES[@]}"
  echo "${VLLM_SITE_PACKAGES[*]}" > .vllm_site/.p2pweights-packages
fi
# Build and test tools.
$PIP "pybind11>=2.13" "scikit-build-core>=0.10" cmake ninja pytest pytest-benchmark hypothesis "ruff==0.17.6"
# The package itself (C++ core built by scikit-build-core + CMake).
$PIP --no-build-isolation .
echo "p2pweights installed: run 'p2pweights doctor' or 'p2pweights demo'"
