# session 20, call E (issue 40): dense and MAGE at 128k, batch 4 then 1, with the tile tournament's tiles of 16
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 200 python -m benchmarks.throughput --sections mage128k --long-batches 4 1 --long-methods mage \
    --budget-s 170 --tag _issue40_s20e --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -7
