# session 18, call B (issue 40): the mage128k section at batch 4, all five methods with byte ideals
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 450 python -m benchmarks.throughput --sections mage128k --long-batches 4 --budget-s 400 --tag _issue40_s18_b4 \
    --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -14
