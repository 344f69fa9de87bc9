# session 15 call 4 (issue 42): LLaDA-8B dual cache (1:256:64) with int8 and fp8 weights (bf16: 398.3 tok/s in call 1),
# then SDAR-8B batch 64 fp8 alone with >= 400 s (it ran past 235 s three times; bf16 2350.7, int8 2550.5 tok/s)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
for q in int8 fp8; do
  timeout 80 python -m benchmarks.throughput --sections llada --llada-runs 1:256:64 --llada-caches dual \
    --budget-s 70 --out /tmp/r --tag _issue42_s15_llada_$q --quantize $q 2>&1 | grep -v "Warn\|warn(" \
    | grep "^| 1024\|skipped\|Error" | sed "s/^/$q /" | tail -2
done
timeout 420 python -m benchmarks.throughput --sections sdar --sdar-prompts 1024 --sdar-batches 64 --budget-s 400 \
    --out /tmp/r --tag _issue42_s15_fp8_b64 --quantize fp8 2>&1 | grep -v "Warn\|warn(" \
    | grep "^| 1024\|skipped\|Error\|compile" | tail -4
