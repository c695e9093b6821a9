#!/bin/bash
# Repeatedly import $1 and install the missing module into /tmp/vllm_site (--no-deps).
declare -A MAP=( [openai_harmony]=oss-harmony [cpuinfo]=py-cpuinfo [pythonjsonlogger]=python-json-logger [yaml]=pyyaml [cv2]=opencv-python-headless [PIL]=pillow [mistral_common]=mistral_common [prometheus_fastapi_instrumentator]=prometheus-fastapi-instrumentator [lmformatenforcer]=lm-format-enforcer [google]=protobuf [model_hosting_container_standards]=model-hosting-container-standards [opentelemetry]=opentelemetry-api [outlines_core]=outlines_core==0.2.14 [lark]=lark==1.2.2 [depyf]=depyf==0.20.0 [llguidance]="llguidance<1.8" )
for i in $(seq 1 25); do
  out=$(PYTHONPATH=/tmp/vllm_site timeout 300 python3 -c "$1" 2>&1)
  mod=$(echo "$out" | grep -oP "No module named '\K[^'.]+" | tail -1)
  if [ "$mod" = vllm ]; then echo "$out" | tail -15; break; fi
  if [ -z "$mod" ]; then echo "$out" | tail -15; break; fi
  pkg=${MAP[$mod]:-$mod}
  echo "missing $mod -> installing $pkg"
  python3 -m pip install -q --no-deps --target /tmp/vllm_site "$pkg" 2>&1 | grep -v -e WARNING -e "already exists" | tail -3
done
