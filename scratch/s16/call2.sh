# next session, call A (issue 38 + 40): the one GPU test session 15 could not finish, then MAGE / dense at 128k with
# and without XLA's command buffers for while loops and conditionals (MAGE's per-layer lax.switch is a host round
# trip per layer without them: the 8.4 ms of launch gaps per block, session 14?)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider \
  "tests/test_kernels.py::TestKernelsGPU::test_float32_head_dim_128_default_tiles" 2>&1 | tail -2
timeout 200 python -m benchmarks.throughput --sections mage128k --long-batches 1 --budget-s 185 --tag _issue40_s16 \
    --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | tail -8
XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" timeout 200 python -m benchmarks.throughput \
    --sections mage128k --long-batches 1 --budget-s 185 --tag _issue40_s16_cb --out /tmp/r 2>&1 \
    | grep -v "Warn\|warn(" | grep "^|" | tail -8
