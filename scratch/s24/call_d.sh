#!/bin/bash
# session 24 call D (issue 42): LLaDA-8B dual cache fp8 against bf16 in one call (call C's fp8 row compiled past its
# 90 s), then SDAR-8B batch 64 fp8 with whatever time is left (its first call compiled past 264 s in call C)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
llada() {  # tag, seconds, quantize flags
  timeout $2 python -m benchmarks.throughput --sections llada --llada-runs 1:256:64 --llada-caches dual \
    --budget-s $(($2 - 20)) --out /tmp/r --tag _s24d_llada_$1 $3 2>&1 | grep -v "Warn\|warn(" | grep "^| \|skipped\|Error" | sed "s/^/$1 /" | tail -3
  echo "t=$(( $(date +%s) - start ))"
}
llada bf16 60 ""
llada fp8 220 "--quantize fp8"
left=$(( 570 - ($(date +%s) - start) ))
echo "left for fp8 b64: $left s"
[ $left -gt 60 ] && timeout $left python -m benchmarks.throughput --sections sdar --sdar-prompts 1024 --sdar-batches 64 \
    --method-points --budget-s $(($left - 10)) --out /tmp/r --tag _s24d_sdar_fp8_b64 --quantize fp8 2>&1 \
    | grep -v "Warn\|warn(" | grep "^| \|skipped\|Error" | tail -3
echo "t=$(( $(date +%s) - start ))"
ls /tmp/r
