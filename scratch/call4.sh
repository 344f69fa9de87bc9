# session 11 call 4: issue 42's accuracy of the quantized models, LLaDA-8B dual-cache rows bf16 / int8 / fp8, the W8A8 probe
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/r
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 110 python -m benchmarks.quantization --parts trained --models checkpoints/tiny-sdar-tasks,checkpoints/tiny-llada-tasks \
    --contexts 1024 --out /tmp/r --tag _issue42_tasks 2>&1 | grep "^|" | tail -20
timeout 110 python -m benchmarks.quantization --parts shapes --out /tmp/r --tag _issue42_shapes 2>&1 | grep "^|" | tail -8
for q in bf16 int8 fp8; do
  flag=""; [ $q != bf16 ] && flag="--quantize $q"
  timeout 75 python -m benchmarks.throughput --sections llada --llada-runs 1:256:64 --llada-caches dual \
      --budget-s 45 --out /tmp/r --tag _issue42_llada_$q $flag 2>&1 | grep -v "Warn\|warn(" | grep "^| LLaDA" | tail -4
done
timeout 90 python -m benchmarks.quantization --parts trained --models checkpoints/tiny-sdar-long,checkpoints/tiny-llada-long \
    --contexts 4096 --out /tmp/r --tag _issue42_long 2>&1 | grep "^|" | tail -20
LAYERS=8 KINDS="int8t int8dyn fp8t" MS="256" timeout 45 python scratch/quant_probe.py 2>&1 | grep "^|"
