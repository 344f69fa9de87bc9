# session 13 call 6 (issue 42): SDAR-8B batch 1, 1k prompt: int8 and bf16 end to end as they are, with XLA's exhaustive
# GEMM tiling search, and with while loops / conditionals in CUDA-graph command buffers (no host sync per iteration)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
CB="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
row() {  # tag, quantize flag, XLA_FLAGS
  XLA_FLAGS="$3" timeout 112 python -m benchmarks.throughput --sections sdar --sdar-prompts 1024 --sdar-batches 1 \
    --method-points --budget-s 95 --out /tmp/r --tag _issue42f_$1 $2 2>&1 | grep -v "Warn\|warn(" | grep "^| 1024\|skipped\|Error" | sed "s/^/$1 /" | tail -2
}
row int8 "--quantize int8" ""
row bf16 "" ""
row int8_cb "--quantize int8" "$CB"
row bf16_cb "" "$CB"
row int8_exh "--quantize int8" "--xla_gpu_exhaustive_tiling_search=true"
