# session 14 call 4 (issue 42): SDAR-8B batch 64, 1k prompts, int8 and fp8 (bf16 batch 64: 2353.6 tok/s, session 13)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
row() {  # tag, quantize flag, batch, seconds
  timeout $4 python -m benchmarks.throughput --sections sdar --sdar-prompts 1024 --sdar-batches $3 \
    --budget-s $(($4 - 20)) --out /tmp/r --tag _issue42_s14_$1 $2 2>&1 | grep -v "Warn\|warn(" | grep "^| 1024\|skipped\|Error" | sed "s/^/$1 /" | tail -2
}
row int8_b64 "--quantize int8" 64 240
row fp8_b64 "--quantize fp8" 64 235
row bf16_b64 "" 64 115
