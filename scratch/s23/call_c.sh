# session 23, call C (issue 40): mage128k at batch 4 and batch 1 (dense, MAGE) with session 22's launch cuts
# (combine kernel, in-kernel fold, the block read in place), which call B showed at batch 1 (1.57x against 1.48x)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
for b in 4 1; do
  timeout 170 python -m benchmarks.throughput --sections mage128k --long-batches $b --long-methods mage --budget-s 140 \
      --out /tmp/r --tag _issue40_s23c_b$b 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -3
done
timeout 130 python -m benchmarks.throughput --sections mage128k --long-batches 1 --long-methods mage --budget-s 100 \
    --out /tmp/r --tag _issue40_s23c_b1r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -3
