# next session, call A: FlashBlock and FlashBlock + MAGE at 128k with session 22's in-place block read (never timed:
# their GPU tests pass), batch 4 then batch 1, each against its call's dense, with MAGE beside them
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
for b in 4 1; do
  timeout 250 python -m benchmarks.throughput --sections mage128k --long-batches $b \
      --long-methods mage flashblock flashblock+mage --budget-s 200 --out /tmp/r --tag _issue40_next_b$b 2>&1 \
      | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -4
done
