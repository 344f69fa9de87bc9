# session 11 call 1: issue 42's quantized-GEMM probe, issue 40's kv_scores GPU tests and the mage128k section
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/r /tmp/r/hlo
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
DUMP=/tmp/r/hlo timeout 180 python scratch/quant_probe.py 2>&1 | grep -v "Warn\|warn(" | tail -40
timeout 80 python -m pytest -q -m gpu tests/test_kernels.py -k "kv_scores or split_kv" 2>&1 | tail -3
timeout 300 python -m benchmarks.throughput --sections mage128k --long-batches 1 2 --out /tmp/r --tag _issue40 --budget-s 120 \
    2>&1 | grep -v "Warn\|warn(" | tail -40
tar czf $OUT/r.tgz -C /tmp/r .
