# session 11 call 6: issue 42 with W8A8 from 128 rows: LLaDA-8B dual cache bf16 / int8, SDAR-8B batch 64 bf16 / int8 / fp8
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
for q in bf16 int8; do
  flag=""; [ $q != bf16 ] && flag="--quantize $q"
  timeout 75 python -m benchmarks.throughput --sections llada --llada-runs 1:256:64 --llada-caches dual \
      --budget-s 45 --out /tmp/r --tag _issue42c_llada_$q $flag 2>&1 | grep -v "Warn\|warn(" | grep "^| LLaDA" | tail -4
done
for q in bf16 int8 fp8; do
  flag=""; [ $q != bf16 ] && flag="--quantize $q"
  timeout 125 python -m benchmarks.throughput --sections sdar --sdar-prompts 1024 --sdar-batches 64 \
      --method-points --out /tmp/r --tag _issue42c_b64_$q $flag 2>&1 | grep -v "Warn\|warn(" | grep "^| SDAR" | tail -4
done
