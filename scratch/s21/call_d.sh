# session 21, call D (issue 40): where the top-k kernel's time goes (GPU time per layer, dispatch amortised), then
# CUDA graphs for the whole block (every capturable command type, graphs of any size) at 128k against dense
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 200 python scratch/s21/topk_diag.py 2>&1 | grep -E "^\||Error" | tee /tmp/r/diag.txt | tail -30
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
XLA_FLAGS="$CB" timeout 200 python -m benchmarks.throughput --sections mage128k --long-batches 1 --long-methods mage \
    mage/kernel --budget-s 170 --tag _issue40_s21d_cb --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" \
    | grep -v "^| \`" | tail -4
