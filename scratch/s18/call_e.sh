# session 18, call E (issue 40): the tile tournament's top k against sort at 128k (alone and as the selection), then
# dense and MAGE with select_by="tiles" in the loop at batch 4
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 90 python -m benchmarks.mage_select --lengths 131072 --batches 1 4 --out /tmp/r 2>&1 | grep -v "Warn\|warn(" \
    | grep "^|" | tail -22
timeout 200 python -m benchmarks.throughput --sections mage128k --long-batches 4 --long-methods mage/tiles \
    --budget-s 150 --tag _issue40_s18e --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -4
