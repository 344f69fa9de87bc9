# session 12 call 4: GPU tests (quantize, quantized matmul, split-KV); SDAR-8B batch 1 bf16 / int8 / fp8 (final code); LLaDA dual fp8
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 100 python -m pytest -q -m gpu tests/test_quantize.py tests/test_kernels.py -k "quantize or split_kv or default" -p no:cacheprovider > /tmp/r/gpu_tests4.log 2>&1; tail -2 /tmp/r/gpu_tests4.log
for q in bf16 int8 fp8; do
  flag=""; [ $q != bf16 ] && flag="--quantize $q"
  timeout 110 python -m benchmarks.throughput --sections weights,sdar --sdar-prompts 1024 --sdar-batches 1 \
      --method-points --budget-s 90 --out /tmp/r --tag _issue42d_$q $flag 2>&1 | grep -v "Warn\|warn(" | grep "^| \(weights\|SDAR\)" | tail -4
done
for q in bf16 fp8; do
  flag=""; [ $q != bf16 ] && flag="--quantize $q"
  timeout 75 python -m benchmarks.throughput --sections llada --llada-runs 1:256:64 --llada-caches dual \
      --budget-s 45 --out /tmp/r --tag _issue42d_llada_$q $flag 2>&1 | grep -v "Warn\|warn(" | grep "^| LLaDA" | tail -4
done
