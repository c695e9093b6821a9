#!/usr/bin/env bash
# Build the Python bundles that the GPU machine (no package registry, Python 3.12, torch 2.11+cu130)
# needs for sglang's model classes, NIXL and Mooncake. Run here, on the CPU machine, from anywhere:
#
#   scripts/gpu_bundle.sh [sglang] [nixl] [mooncake]        # none named: all three
#
# Each bundle is one folder under .carry/ (git-ignored) holding site.tar.xz (the stripped site dir)
# and MANIFEST.txt (what is in it). Carry the folder with the device tool's `carry`, then on the
# device `source scripts/gpu_env.sh` unpacks it under /tmp and sets PYTHONPATH / LD_LIBRARY_PATH.
# docs/gpu.md says what is kept and why.
#
# Environment:
#   GPU_BUNDLE_CACHE   where downloaded wheels and .debs are kept (default .carry/wheels; reused)
#   GPU_BUNDLE_FULL=1  sglang bundle: also carry the packages the device image already has
#                      (huggingface_hub, tokenizers, aiohttp, ...; see IMAGE_HAS below), for a bare
#                      Python 3.12 + torch. Larger (≈25 MB instead of 14 MB); default off.
#   GPU_BUNDLE_NIXL_IB=1  nixl bundle: keep UCX's InfiniBand transports (+libibverbs/libmlx5/libnl,
#                      ~6 MB more compressed); default off: the one-GPU machine has no RDMA NIC.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CARRY="$ROOT/.carry"
CACHE="${GPU_BUNDLE_CACHE:-$CARRY/wheels}"
PY=python3
WORK=$(mktemp -d /tmp/p2pw-gpu-bundle.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$CACHE" "$CARRY"

PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64
  manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64
  manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64)

# -- the sglang bundle's packages ----------------------------------------------------------------
# What `import sglang.srt.models.{qwen3,qwen3_moe,deepseek_v2}` after p2pweights'
# sglang_env.prepare() imports (measured on the CPU machine, also with CUDA faked present), minus
# what the device image has (docs/gpu.md, "What the sglang bundle holds"), minus IPython (stubbed).
# Versions are the CPU machine's (scripts/setup.sh), for cp312. orjson 3.8.3 has no cp312 wheel.
SGLANG_PKGS=(
  sglang==0.5.23 transformers==5.19.0 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0
  loguru==0.7.3 gguf==0.19.0 orjson==3.13.0 pybase64==1.5.1 msgspec==0.23.0 pyzmq==27.3.0
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
  starlette==1.10.0 fastapi==0.165.0 uvicorn==0.55.0 dill==0.4.1 partial-json-parser==0.2.1.1.post7
  openai==2.8.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 opentelemetry-api==1.45.2
)
# On the device image already (torch 2.11's own deps: sympy mpmath networkx jinja2 markupsafe
# filelock fsspec typing_extensions; plus scipy, pillow, torchvision 0.26). Carried with
# GPU_BUNDLE_FULL=1 only. huggingface_hub stays 1.x (device has 1.33; transformers 5.19 takes
# >=1.31), which avoids hub 2.x's httpx2/httpcore2/trio chain.
IMAGE_HAS=(
  huggingface-hub==1.33.0 tokenizers==0.23.2 safetensors==0.8.0 regex==2026.5.9 pyyaml==6.0.3
  requests==2.34.2 urllib3==2.7.0 charset-normalizer==3.4.7 certifi==2026.5.20 idna==3.20
  tqdm==4.70.1 packaging==26.2 typer==0.29.2 click==8.5.1 shellingham==1.5.4 rich==15.0.0
  markdown-it-py==4.3.0 mdurl==0.1.2 pygments==2.20.0 psutil==7.2.2 einops==0.8.2
  sentencepiece==0.2.1 anyio==4.16.0 httpx==0.29.0 httpcore==1.0.9 h11==0.16.0
  aiohttp==3.14.5 aiohappyeyeballs==2.7.1 aiosignal==1.4.0 frozenlist==1.8.0 multidict==7.2.1
  propcache==0.5.4 yarl==1.25.1 attrs==26.1.0 annotated-doc==0.0.7 colorama==0.4.6
  sortedcontainers==2.4.0
)
# (hf-xet, which huggingface_hub requires, is left out even then: hub imports it only to download
# from Xet storage, and it is 10 MB.)

# transformers/models/*/modeling_*.py that sglang imports at module level (the rest of modeling_*
# and every modular_*/convert_* are dropped; models/auto, configuration, tokenization and
# processing files stay).
TRANSFORMERS_KEEP_MODELING=(
  clip/modeling_clip.py glmasr/modeling_glmasr.py llama/modeling_llama.py llama4/modeling_llama4.py
  llava/modeling_llava.py mistral3/modeling_mistral3.py mllama/modeling_mllama.py
  parakeet/modeling_parakeet.py pixtral/modeling_pixtral.py qwen2/modeling_qwen2.py
  qwen2_audio/modeling_qwen2_audio.py siglip/modeling_siglip.py vitdet/modeling_vitdet.py
  whisper/modeling_whisper.py
)

log() { echo "[gpu_bundle] $*" >&2; }

# pip download one requirement as a cp312 manylinux wheel (or a pure-Python one), into $CACHE.
fetch() {
  local req=$1 name ver
  name=${req%%==*}; ver=${req#*==}
  local norm
  norm=$(echo "$name" | tr '[:upper:]-.' '[:lower:]__')
  if ls "$CACHE" 2>/dev/null | tr '[:upper:]' '[:lower:]' | grep -q "^${norm}-${ver}-"; then return 0; fi
  local plat=()
  for p in "${PLATFORMS[@]}"; do plat+=(--platform "$p"); done
  log "download $req"
  $PY -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none "${plat[@]}" \
      -d "$CACHE" "$req" 2>&1 | grep -v "is ignored: it is neither" >&2 || true
  ls "$CACHE" | tr '[:upper:]' '[:lower:]' | grep -q "^${norm}-${ver}-" || { log "FAILED: $req"; exit 1; }
}

wheel_of() {  # the cached wheel file of NAME==VER
  local name=${1%%==*} ver=${1#*==} norm
  norm=$(echo "$name" | tr '[:upper:]-.' '[:lower:]__')
  for f in "$CACHE"/*.whl; do
    local b; b=$(basename "$f" | tr '[:upper:]' '[:lower:]')
    if [[ $b == "${norm}-${ver}-"* ]]; then echo "$f"; return; fi
  done
  log "no wheel for $1"; exit 1
}

# Unpack wheels into a site dir; keep only METADATA (+top_level.txt, entry_points.txt) of dist-info
# (importlib.metadata.version() reads METADATA; transformers and sglang check versions).
unpack() {
  local site=$1; shift
  mkdir -p "$site"
  for req in "$@"; do
    fetch "$req"
    unzip -qo "$(wheel_of "$req")" -d "$site"
  done
  find "$site" -path '*.dist-info/*' ! -name METADATA ! -name top_level.txt ! -name entry_points.txt \
       -type f -delete
  find "$site" -path '*.dist-info/*' -type d -empty -delete
  find "$site" -depth -type d \( -name __pycache__ -o -name tests -o -name test \) \
       ! -path '*/sglang/srt/*' ! -path '*/transformers/*' -exec rm -rf {} +
  find "$site" -type f \( -name '*.pyc' -o -name '*.pyi' -o -name py.typed \) -delete
  # a wheel's .data/{scripts,headers,data}: console scripts and headers are not needed
  find "$site" -maxdepth 1 -type d -name '*.data' -exec rm -rf {} +
}

pack() {  # pack SITE_DIR into BUNDLE_DIR/site.tar.xz with a manifest
  local site=$1 out=$2
  rm -rf "$out"; mkdir -p "$out"
  (cd "$site" && find . -type f | LC_ALL=C sort > "$WORK/files.txt")
  {
    echo "# p2pweights GPU bundle $(basename "$out"), built $(date -u +%FT%TZ) by scripts/gpu_bundle.sh"
    echo "# unpacked size: $(du -sh "$site" | cut -f1), files: $(wc -l < "$WORK/files.txt")"
    echo "# distributions:"
    (cd "$site" && ls -d *.dist-info 2>/dev/null | sed 's/\.dist-info$//; s/^/#   /')
    echo "# top-level entries:"
    (cd "$site" && ls -A | grep -v '\.dist-info$' | sed 's/^/#   /')
  } > "$out/MANIFEST.txt"
  XZ_OPT=-9e tar -C "$site" --owner=0 --group=0 --numeric-owner --sort=name -cJf "$out/site.tar.xz" .
  log "$(basename "$out"): $(du -sh "$site" | cut -f1) unpacked -> $(du -h "$out/site.tar.xz" | cut -f1) site.tar.xz"
}

# -- sglang --------------------------------------------------------------------------------------
build_sglang() {
  local site="$WORK/sglang"
  local pkgs=("${SGLANG_PKGS[@]}")
  if [[ ${GPU_BUNDLE_FULL:-0} == 1 ]]; then pkgs+=("${IMAGE_HAS[@]}"); fi
  unpack "$site" "${pkgs[@]}"

  # sglang: drop what model construction and weight loading never import.
  rm -rf "$site"/sglang/test "$site"/sglang/benchmark "$site"/sglang/multimodal_gen
  # Rust extensions (server, gRPC, multimodal, radix-tree core): 45 MB of .so, imported lazily only.
  find "$site/sglang" -name '*.so' -delete
  # JIT kernel sources (compiled at first kernel call, never during construction/loading).
  find "$site/sglang" -type f \( -name '*.cu' -o -name '*.cuh' -o -name '*.h' -o -name '*.hpp' \
       -o -name '*.cpp' -o -name '*.cc' -o -name '*.hip' -o -name '*.md' -o -name '*.js' \
       -o -name '*.mjs' \) -delete

  # transformers: drop models/*/modeling_* and modular_* (except what sglang imports), converters.
  local tm="$site/transformers/models"
  find "$tm" -type f \( -name 'modeling_*' -o -name 'modular_*' -o -name 'convert_*' \) \
       ! -path "$tm/auto/*" -printf '%P\n' | while read -r rel; do
    local keep=0
    for k in "${TRANSFORMERS_KEEP_MODELING[@]}"; do [[ $rel == "$k" ]] && keep=1 && break; done
    [[ $keep == 1 ]] || rm -f "$tm/$rel"
  done
  # openai's command-line tool (openai.cli) is imported by nothing here.
  rm -rf "$site"/openai/cli

  # Import stubs (see docs/gpu.md): IPython (sglang.utils imports IPython.display at module level)
  # and sgl_kernel (sglang's CUDA path imports its ops at module level; never called here).
  mkdir -p "$site/IPython" "$site/sgl_kernel"
  cat > "$site/IPython/__init__.py" <<'EOF'
"""p2pweights import stub for IPython: sglang.utils imports IPython.display.{HTML,display} at
module level (notebook helpers). Nothing else of IPython is used. See docs/gpu.md."""
__version__ = "0.0.0+p2pweights.stub"
P2PW_STUB = True
EOF
  cat > "$site/IPython/display.py" <<'EOF'
"""p2pweights stub of IPython.display: HTML holds its text, display prints a repr."""


class HTML:
    def __init__(self, data=None, *args, **kwargs):
        self.data = data

    def __repr__(self):
        return f"HTML({self.data!r})"


def display(*objs, **kwargs):
    for obj in objs:
        print(repr(obj))
EOF
  cat > "$site/sgl_kernel/__init__.py" <<'EOF'
"""p2pweights import stub for sglang-kernel (sgl_kernel); see docs/gpu.md.

With CUDA present sglang imports sgl_kernel's ops at module level (activation, layernorm, topk,
quantization schemes ...). Building a model on the meta device and running bf16 weight loaders
never calls them. Every attribute is a placeholder that raises NotImplementedError when called,
so a kernel that is really used fails loudly; submodules (sgl_kernel.scalar_type, ...) are stubs.
Set P2PW_NO_SGL_KERNEL_STUB=1 (or true/yes/on) to make `import sgl_kernel` fail instead.
"""
import importlib.abc
import importlib.machinery
import os
import sys
import types

# the true spellings of p2pweights.settings.parse_bool (tests/test_settings.py keeps them equal); the
# stub is imported by sglang, so it does not import p2pweights back
if os.environ.get("P2PW_NO_SGL_KERNEL_STUB", "").strip().lower() in ("1", "true", "yes", "on"):
    raise ImportError("sgl_kernel: p2pweights stub disabled by P2PW_NO_SGL_KERNEL_STUB=1")

__version__ = "0.0.0+p2pweights.stub"
P2PW_STUB = True


class _Placeholder:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name}: sgl_kernel is a p2pweights import stub here")

    def __mro_entries__(self, bases):
        return (object,)

    def __repr__(self):
        return f"<sgl_kernel stub {self._name}>"


def _module_getattr(name):
    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{name}.{attr}")

    return __getattr__


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.P2PW_STUB = True
        module.__getattr__ = _module_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


if not any(type(f).__name__ == "_Finder" and type(f).__module__ == __name__ for f in sys.meta_path):
    sys.meta_path.insert(0, _Finder())
__getattr__ = _module_getattr(__name__)
EOF
  pack "$site" "$CARRY/gpu-sglang"
}

# -- ELF dependency closure helper ---------------------------------------------------------------
# needed_closure ROOT_FILES... : print every file under LIBDIRS (env) reached by DT_NEEDED from ROOTS.
needed_closure() {
  $PY - "$@" <<'EOF'
import os, subprocess, sys
libdirs = os.environ["LIBDIRS"].split(":")
by_name = {}
for d in libdirs:
    for n in os.listdir(d):
        p = os.path.join(d, n)
        if os.path.isfile(p):
            by_name.setdefault(n, p)
todo, seen = list(sys.argv[1:]), set()
while todo:
    f = todo.pop()
    if f in seen:
        continue
    seen.add(f)
    out = subprocess.run(["readelf", "-d", f], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if "(NEEDED)" in line:
            lib = line.split("[", 1)[1].rstrip("]")
            if lib in by_name:
                todo.append(by_name[lib])
for f in sorted(seen):
    print(f)
EOF
}

# -- NIXL ----------------------------------------------------------------------------------------
build_nixl() {
  local site="$WORK/nixl"
  unpack "$site" nixl-cu13==1.5.1
  rm -rf "$site"/nixl_ep_cu13 "$site"/nixl_cu13.scripts
  local meson="$site/.nixl_cu13.mesonpy.libs" libs="$site/nixl_cu13.libs"
  # Plugins: UCX only (both copies the wheel ships: mesonpy's and auditwheel's).
  find "$meson/plugins" "$libs/nixl" -type f ! -name 'libplugin_UCX.so' -delete
  rm -f "$meson"/libnixl_test_utils.so
  # UCX transport modules: shared memory (cma), CUDA (cuda_copy/cuda_ipc/gdr_copy), memory hooks.
  find "$libs/ucx" -type f \( -name '*.la' -o -name 'libucx_perftest*' \) -delete
  if [[ ${GPU_BUNDLE_NIXL_IB:-0} != 1 ]]; then
    find "$libs/ucx" -type f -name 'libuct_ib*' -delete
  fi
  # Keep only the shared libraries that the bindings, the UCX plugin and UCX's modules reach
  # (drops etcd/gRPC, AWS/Azure object-store, prometheus and liburing, which other plugins use).
  local roots
  # libnixl_capi.so: the C API the native NIXL transport dlopens (nothing in the wheel links it).
  roots="$(find "$site/nixl_cu13" "$meson/plugins" "$libs/nixl" "$libs/ucx" -type f -name '*.so*') $meson/libnixl_capi.so"
  LIBDIRS="$meson:$libs" needed_closure $roots > "$WORK/nixl_keep.txt"
  for f in "$libs"/*.so* "$meson"/*.so*; do
    grep -qxF "$f" "$WORK/nixl_keep.txt" || rm -f "$f"
  done
  pack "$site" "$CARRY/gpu-nixl"
}

# -- Mooncake ------------------------------------------------------------------------------------
build_mooncake() {
  local site="$WORK/mooncake"
  unpack "$site" mooncake-transfer-engine-cuda13==0.3.14
  local pkg="$site/mooncake" libs="$site/mooncake_transfer_engine_cuda13.libs"
  # Transfer engine only: keep __init__.py, engine.so, libasio.so, libetcd_wrapper.so, buffer_pool.py.
  find "$pkg" -mindepth 1 -maxdepth 1 ! -name __init__.py ! -name engine.so ! -name libasio.so \
       ! -name libetcd_wrapper.so ! -name buffer_pool.py -exec rm -rf {} +
  LIBDIRS="$pkg:$libs" needed_closure "$pkg/engine.so" > "$WORK/mc_keep.txt"
  for f in "$libs"/*.so*; do
    grep -qxF "$f" "$WORK/mc_keep.txt" || rm -f "$f"
  done
  # libibverbs / libmlx5 (+ providers, libnl, libnuma) from Debian packages, onto lib/.
  local debs="$CACHE/debs"
  mkdir -p "$debs"
  local want=(libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1)
  if ! (cd "$debs" && for p in "${want[@]}"; do ls ${p}_*.deb >/dev/null 2>&1 || exit 1; done); then
    log "apt-get download ${want[*]}"
    (cd "$debs" && apt-get download "${want[@]}" 2>&1 | grep -v "unsandboxed as root" >&2 || true)
  fi
  local x="$WORK/debroot"
  for d in "$debs"/*.deb; do dpkg -x "$d" "$x"; done
  mkdir -p "$site/lib/libibverbs" "$site/etc"
  local f
  for f in libibverbs libmlx5 libnl-3 libnl-route-3 libnuma; do
    cp -a "$x"/usr/lib/x86_64-linux-gnu/$f.so.* "$x"/lib/x86_64-linux-gnu/$f.so.* "$site/lib/" 2>/dev/null || true
  done
  for f in libibverbs.so.1 libmlx5.so.1 libnl-3.so.200 libnl-route-3.so.200 libnuma.so.1; do
    [[ -e "$site/lib/$f" ]] || { log "missing $f in the .debs"; exit 1; }
  done
  # verbs providers: keep mlx5 (the NICs these clusters have) and its driver file
  cp -a "$x"/usr/lib/x86_64-linux-gnu/libibverbs/libmlx5-rdmav*.so "$site/lib/libibverbs/" 2>/dev/null || true
  cp -a "$x"/etc/libibverbs.d "$site/etc/" 2>/dev/null || true
  pack "$site" "$CARRY/gpu-mooncake"
}

targets=("$@")
[[ ${#targets[@]} -gt 0 ]] || targets=(sglang nixl mooncake)
for t in "${targets[@]}"; do
  case $t in
    sglang) build_sglang ;;
    nixl) build_nixl ;;
    mooncake) build_mooncake ;;
    *) log "unknown bundle '$t' (sglang, nixl, mooncake)"; exit 2 ;;
  esac
done
du -sh "$CARRY"/gpu-* >&2
