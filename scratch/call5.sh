# session 11 call 5: issue 42 with W8A8 from 128 rows: GPU tests, SDAR-8B batch 1 and 64, bf16 / int8 / fp8
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 50 python -m pytest -q -m gpu tests/test_quantize.py 2>&1 | tail -2
for q in bf16 int8 fp8; do
  flag=""; [ $q != bf16 ] && flag="--quantize $q"
  timeout 170 python -m benchmarks.throughput --sections weights,sdar --sdar-prompts 1024 --sdar-batches 1 64 \
      --method-points --budget-s 140 --out /tmp/r --tag _issue42c_$q $flag 2>&1 | grep -v "Warn\|warn(" | grep "^| \(weights\|SDAR\)" | tail -4
done
