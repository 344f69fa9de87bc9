# session 11 call 2: issue 42's SDAR-8B rows, bf16 / int8 / fp8 on one machine (weights section + generate at batch 1 and 64)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/r
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
for q in bf16 int8 fp8; do
  flag=""; [ $q != bf16 ] && flag="--quantize $q"
  timeout 190 python -m benchmarks.throughput --sections weights,sdar --sdar-prompts 1024 --sdar-batches 1 64 \
      --method-points --budget-s 120 --out /tmp/r --tag _issue42_$q $flag 2>&1 | grep -v "Warn\|warn(" | grep "^|" | tail -12
done
tar czf $OUT/r.tgz -C /tmp/r .
