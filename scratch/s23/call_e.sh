# session 23, call E (issue 40): mage128k at batch 4 then batch 1 (dense, MAGE) with the final code (the per-row
# combine kernel), both bars in one call
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
for b in 4 1; do
  timeout 120 python -m benchmarks.throughput --sections mage128k --long-batches $b --long-methods mage --budget-s 90 \
      --out /tmp/r --tag _issue40_s23e_b$b 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -2
  grep -h "split_kv_combine\|GPU kernels" /tmp/r/throughput_issue40_s23e_b${b}_*.md | head -4
done
