# session 14 call 3 (issue 40): MAGE / FlashBlock at 128k against dense with generate's capacity, batches 1 and 2
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 570 python -m benchmarks.throughput --sections mage128k --long-batches 1 2 --budget-s 520 --tag _issue40_s14 \
    --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | tail -40
