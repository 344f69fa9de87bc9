# next session, call B (issue 40, batch 1 is bound by the host's ~8-9 us per launch): CUDA graphs for the whole block.
# Session 20's `+WHILE` (added to XLA's default capture set) gave nothing beyond noise; here every capturable type is
# named explicitly, graphs of any size are formed, and the block is timed at batch 1 and 4 against dense under the same
# flags (dense runs the same while loops)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
XLA_FLAGS="$CB" timeout 250 python -m benchmarks.throughput --sections mage128k --long-batches 1 4 --long-methods mage \
    --budget-s 220 --tag _issue40_s21b_cb --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -5
