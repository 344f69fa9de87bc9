# session 11 call 3: issue 42's GPU tests, the W8A8 probe, SDAR-8B batch-1 rows bf16 / int8 / fp8 (the LM head quantized too)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/r
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 70 python -m pytest -q -m gpu tests/test_quantize.py 2>&1 | tail -4
KINDS="int8t int8dyn fp8t" MS="64 128 256" timeout 80 python scratch/quant_probe.py 2>&1 | grep "^|"
for q in bf16 int8 fp8; do
  flag=""; [ $q != bf16 ] && flag="--quantize $q"
  timeout 140 python -m benchmarks.throughput --sections weights,sdar --sdar-prompts 1024 --sdar-batches 1 \
      --method-points --budget-s 100 --out /tmp/r --tag _issue42b_$q $flag 2>&1 | grep -v "Warn\|warn(" | grep "^| \(weights\|SDAR\)" | tail -4
done
tar czf $OUT/r.tgz -C /tmp/r .
