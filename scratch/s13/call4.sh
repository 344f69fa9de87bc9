# session 13 call 4: issue 42 rows, fp8 (SDAR-8B batch 1 and 64, weight step); LLaDA-8B dual cache bf16 / int8 / fp8
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 290 python -m benchmarks.throughput --sections weights,sdar --sdar-prompts 1024 --sdar-batches 1 64 \
    --method-points --budget-s 240 --out /tmp/r --tag _issue42e_fp8 --quantize fp8 2>&1 | grep -v "Warn\|warn(" \
    | grep "^| [0-9]\|skipped" | tail -12
for q in bf16 int8 fp8; do
  flag=""; [ $q != bf16 ] && flag="--quantize $q"
  timeout 85 python -m benchmarks.throughput --sections llada --llada-runs 1:256:64 --llada-caches dual \
      --budget-s 55 --out /tmp/r --tag _issue42e_llada_$q $flag 2>&1 | grep -v "Warn\|warn(" | grep "^| [0-9]\|skipped" | tail -4
done
