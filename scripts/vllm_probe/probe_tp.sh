#!/bin/bash
# usage: probe_tp.sh CFG_DIR TP  — one process per TP rank, gloo, like torchrun would start them.
cfg=$1; tp=$2; port=$((29600 + RANDOM % 300))
for r in $(seq 0 $((tp-1))); do
  RANK=$r LOCAL_RANK=$r WORLD_SIZE=$tp MASTER_ADDR=127.0.0.1 MASTER_PORT=$port PYTHONPATH=/tmp/vllm_site HF_HUB_OFFLINE=1 \
    timeout 600 python3 /tmp/vllm_probe/probe_load.py $cfg > /tmp/vllm_probe/log_tp${tp}_r$r.txt 2>&1 &
done
wait
for r in $(seq 0 $((tp-1))); do grep -E "^\[|Error|error:" /tmp/vllm_probe/log_tp${tp}_r$r.txt | tail -12; done
