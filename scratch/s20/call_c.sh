# session 20, call C (issue 40): dense and MAGE at 128k, batch 4 then 1, with the state written back only where it
# changed; then the same with while loops in CUDA-graph command buffers (no conditional is left in MAGE's block)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 250 python -m benchmarks.throughput --sections mage128k --long-batches 4 1 --long-methods mage \
    --budget-s 220 --tag _issue40_s20c --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -7
XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE timeout 220 python -m benchmarks.throughput \
    --sections mage128k --long-batches 4 1 --long-methods mage --budget-s 190 --tag _issue40_s20c_cb --out /tmp/r 2>&1 \
    | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -7
