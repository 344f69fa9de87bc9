# session 22, call C (issue 40): CUDA graphs (XLA command buffers for every capturable command, while loops and
# conditionals included, graphs of any size) for dense and MAGE(select_after_forward) at 128k, batch 1 then 4
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
export XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
for b in 1 4; do
timeout 230 python -m benchmarks.throughput --sections mage128k --long-batches $b --long-methods mage/after \
    mage/after+kernel mage/after+probs --budget-s 200 --tag _issue40_s22c_cb$b --out /tmp/r > /tmp/r/bench_c$b.txt 2>&1
echo "bench rc $?"; grep -v "Warn\|warn(" /tmp/r/bench_c$b.txt | grep "^|" | grep -v "^| \`" | tail -5
done
