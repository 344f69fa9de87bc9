# session 18, call A (issue 40): the mage128k section at batch 1, all five methods (dense, MAGE, MAGE/threshold,
# FlashBlock, FlashBlock + MAGE) with byte ideals; then the sort chunk length at 128k
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python -m benchmarks.throughput --sections mage128k --long-batches 1 --budget-s 280 --tag _issue40_s18_b1 \
    --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -14
timeout 120 python -m benchmarks.mage_select --lengths 131072 --batches 1 4 --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | tail -20
