#!/bin/bash
# session 24 call C (issue 42): the rows not yet measured on an H200 in one call: LLaDA-8B dual cache bf16 / int8 /
# fp8, SDAR-8B batch 1 bf16 / fp8, then SDAR-8B batch 64 fp8 (three earlier calls ran past 235 s on it)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
start=$(date +%s)
llada() {  # tag, quantize flags
  timeout 90 python -m benchmarks.throughput --sections llada --llada-runs 1:256:64 --llada-caches dual \
    --budget-s 70 --out /tmp/r --tag _s24c_llada_$1 $2 2>&1 | grep -v "Warn\|warn(" | grep "^| \|skipped\|Error" | sed "s/^/$1 /" | tail -3
  echo "t=$(( $(date +%s) - start ))"
}
sdar() {  # tag, batch, seconds, quantize flags
  timeout $3 python -m benchmarks.throughput --sections sdar --sdar-prompts 1024 --sdar-batches $2 --method-points \
    --budget-s $(($3 - 15)) --out /tmp/r --tag _s24c_sdar_$1 $4 2>&1 | grep -v "Warn\|warn(" | grep "^| \|skipped\|Error" | sed "s/^/$1 /" | tail -3
  echo "t=$(( $(date +%s) - start ))"
}
llada bf16 ""
llada int8 "--quantize int8"
llada fp8 "--quantize fp8"
sdar bf16_b1 1 80 ""
sdar fp8_b1 1 90 "--quantize fp8"
left=$(( 560 - ($(date +%s) - start) ))
echo "left for fp8 b64: $left s"
[ $left -gt 60 ] && sdar fp8_b64 64 $left "--quantize fp8"
ls /tmp/r
