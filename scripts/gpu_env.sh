# shellcheck shell=bash
# Source ON the GPU machine, from the repository root, after carrying the bundles that
# scripts/gpu_bundle.sh built (.carry/gpu-sglang, .carry/gpu-nixl, .carry/gpu-mooncake):
#
#   source scripts/gpu_env.sh            # unpacks what is present under /tmp/p2pw-gpu, sets env
#   p2pw_gpu_check                       # imports everything and prints versions (optional)
#
# For each bundle present it unpacks .carry/gpu-NAME/site.tar.xz into $P2PW_GPU_SITE/NAME (default
# /tmp/p2pw-gpu/NAME; skipped when the same bundle is already unpacked there) and sets:
#   sglang   : PYTHONPATH (ahead of the image's site-packages, so transformers 5.19 wins over 5.17)
#   nixl     : PYTHONPATH, UCX_MODULES=^efa (else every NIXL process segfaults at exit where
#              rdma-core is present, as on the lent GPU machines; docs/gpu.md)
#   mooncake : PYTHONPATH, LD_LIBRARY_PATH (bundle's lib/ with libibverbs/libmlx5/libnl/libnuma, and
#              the CUDA runtime of the image's torch for engine.so's libcudart.so.13)
# P2PW_GPU_SITE is a declared (script-only) setting: `p2pweights doctor` knows it.
# Nothing here exits the calling shell; a missing bundle is skipped.

_p2pw_gpu_unpack() {  # NAME -> prints the unpacked folder, or nothing
  local name=$1 src=".carry/gpu-$1" dest="${P2PW_GPU_SITE:-/tmp/p2pw-gpu}/$1"
  [ -f "$src/site.tar.xz" ] || return 0
  if [ -f "$dest/.p2pw-manifest" ] && cmp -s "$src/MANIFEST.txt" "$dest/.p2pw-manifest"; then
    echo "$dest"; return 0
  fi
  rm -rf "$dest" && mkdir -p "$dest" || return 1
  if command -v xz >/dev/null 2>&1; then
    tar -xJf "$src/site.tar.xz" -C "$dest" || return 1
  else
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
      "$src/site.tar.xz" "$dest" || return 1
  fi
  # The bundles carry no .pyc (they are built here for another Python); compiling on first import
  # cost ~8.5 s of a cold connect on the H200. Compile once per unpack, on every core.
  python3 -m compileall -q -j 0 "$dest" >/dev/null 2>&1 || true
  cp "$src/MANIFEST.txt" "$dest/.p2pw-manifest"
  echo "$dest"
}

_p2pw_gpu_env() {
  local d found=""
  d=$(_p2pw_gpu_unpack sglang) || { echo "gpu_env: unpacking gpu-sglang failed" >&2; return 1; }
  if [ -n "$d" ]; then
    export PYTHONPATH="$d${PYTHONPATH:+:$PYTHONPATH}"
    found="$found sglang"
  fi
  d=$(_p2pw_gpu_unpack nixl) || { echo "gpu_env: unpacking gpu-nixl failed" >&2; return 1; }
  if [ -n "$d" ]; then
    export PYTHONPATH="$d${PYTHONPATH:+:$PYTHONPATH}"
    export UCX_MODULES="${UCX_MODULES:-^efa}"
    found="$found nixl"
  fi
  d=$(_p2pw_gpu_unpack mooncake) || { echo "gpu_env: unpacking gpu-mooncake failed" >&2; return 1; }
  if [ -n "$d" ]; then
    export PYTHONPATH="$d${PYTHONPATH:+:$PYTHONPATH}"
    local cudart
    cudart=$(python3 - <<'EOF' 2>/dev/null
import glob, os, site, sysconfig
roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()}
hits = sorted({os.path.dirname(p) for r in roots for p in glob.glob(os.path.join(r, "nvidia", "**", "libcudart.so.13*"), recursive=True)})
print(":".join(hits))
EOF
)
    export LD_LIBRARY_PATH="$d/lib${cudart:+:$cudart}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    found="$found mooncake"
  fi
  # NVLink multicast stays off on the lent GPU machines (docs/gpu.md); the image sets these,
  # this only makes sure a fresh shell has them too.
  export NCCL_NVLS_ENABLE="${NCCL_NVLS_ENABLE:-0}"
  export TORCH_SYMM_MEM_DISABLE_MULTICAST="${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1}"
  export NVSHMEM_DISABLE_NVLS="${NVSHMEM_DISABLE_NVLS:-1}"
  echo "gpu_env: bundles:${found:- none} (under ${P2PW_GPU_SITE:-/tmp/p2pw-gpu})" >&2
}

# Import what each unpacked bundle provides and print where it came from; non-zero on failure.
p2pw_gpu_check() {
  python3 - "$@" <<'EOF'
import importlib, os, sys, time, traceback
ok = True
def step(label, fn):
    global ok
    t = time.time()
    try:
        out = fn()
        print(f"OK   {label} ({time.time() - t:.1f}s){': ' + str(out) if out else ''}")
    except BaseException:
        ok = False
        print(f"FAIL {label}")
        traceback.print_exc(limit=-6)
def mod(name):
    m = importlib.import_module(name)
    return f"{getattr(m, '__version__', '')} {getattr(m, '__file__', '')}"
site = os.environ.get("P2PW_GPU_SITE", "/tmp/p2pw-gpu")
step("torch", lambda: (mod("torch"), __import__("torch").cuda.is_available()))
if os.path.isdir(os.path.join(site, "sglang")):
    step("transformers", lambda: mod("transformers"))
    def sg():
        # p2pweights' prepare() when p2pweights (with its built _native core) imports; else the
        # same imports by hand.
        try:
            from p2pweights.replica import sglang_env
        except ImportError as e:
            print(f"     (p2pweights not importable: {e}; importing sglang directly)")
            import transformers.utils.import_utils  # noqa: F401
            import sglang.srt.model_loader.loader  # noqa: F401
            import sglang.srt.models.registry  # noqa: F401
            how = "direct"
        else:
            sglang_env.prepare()
            how = "sglang_env.prepare()"
        import sglang.srt.models.qwen3, sglang.srt.models.qwen3_moe, sglang.srt.models.deepseek_v2  # noqa
        import sgl_kernel
        return f"{how}; sglang {mod('sglang')}; sgl_kernel stub: {getattr(sgl_kernel, 'P2PW_STUB', False)}"
    step("sglang + qwen3/qwen3_moe/deepseek_v2", sg)
if os.path.isdir(os.path.join(site, "nixl")):
    step("nixl_cu13", lambda: mod("nixl_cu13"))
    def agent():
        import nixl_cu13 as n
        a = n.nixl_agent("p2pw-check", n.nixl_agent_config(backends=["UCX"]))
        return "UCX agent created"
    step("nixl UCX agent", agent)
if os.path.isdir(os.path.join(site, "mooncake")):
    def mc():
        from mooncake.engine import TransferEngine
        te = TransferEngine()
        rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
        return f"TransferEngine.initialize -> {rc}, rpc port {te.get_rpc_port()}"
    step("mooncake engine", mc)
sys.exit(0 if ok else 1)
EOF
}

_p2pw_gpu_env
