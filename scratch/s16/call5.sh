# session 16 call 5 (issue 40): MAGE's later steps with a static SPARSE mode and static exact layers (no per-layer
# switch in the block loop's while body), against dense in the same run, 128k cache, batch 1
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 215 python -m benchmarks.throughput --sections mage128k --long-batches 1 --budget-s 150 --tag _issue40_s16_static \
    --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -12
