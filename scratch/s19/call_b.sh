# call B (issue 40): dense, MAGE (scores from the exact pass's logits) and mage/keys (kv_scores) at 128k, batch 4 then 1;
# then dense and MAGE again with while loops and conditionals in CUDA-graph command buffers
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 290 python -m benchmarks.throughput --sections mage128k --long-batches 4 1 --long-methods mage mage/keys \
    --budget-s 250 --tag _issue40_s19b --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -8
XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL timeout 250 python -m benchmarks.throughput \
    --sections mage128k --long-batches 4 1 --long-methods mage --budget-s 210 --tag _issue40_s19b_cb --out /tmp/r 2>&1 \
    | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -8
