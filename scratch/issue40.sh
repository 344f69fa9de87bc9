# issue 40: MAGE's selection micro-benchmark, the mage128k section (capacity as generate allocates) at
# batches 1 and 2 with MAGE's top k by threshold and by sort, then MAGE's GPU tests; results in $OUT/r.tgz
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/r
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout ${T1:-170} python -m benchmarks.mage_select --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | tail -40
timeout ${T2:-300} python -m benchmarks.throughput --sections mage128k --long-batches 1 2 --out /tmp/r --tag _issue40 \
    2>&1 | grep -v "Warn\|warn(" | tail -25
timeout ${T3:-90} python -m pytest -q -m gpu tests/test_mage.py tests/test_policy_rows.py -x 2>&1 | tail -4
tar czf $OUT/r.tgz -C /tmp/r .
