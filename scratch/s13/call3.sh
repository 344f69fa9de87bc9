# session 13 call 3: issue 42 rows, bf16 and int8: weight-reading step (one call and in the loop), SDAR-8B 1k prompt batch 1 and 64
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
for q in bf16 int8; do
  flag=""; [ $q != bf16 ] && flag="--quantize $q"
  timeout 285 python -m benchmarks.throughput --sections weights,sdar --sdar-prompts 1024 --sdar-batches 1 64 \
      --method-points --budget-s 235 --out /tmp/r --tag _issue42e_$q $flag 2>&1 | grep -v "Warn\|warn(" | grep "^| [0-9]\|skipped" | tail -12
done
