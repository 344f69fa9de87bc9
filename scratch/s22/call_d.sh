# session 22, call D (issue 40): MAGE's new default (select_after_forward=True): its GPU tests, then at 128k under
# XLA's command buffers (CUDA graphs for every capturable command, while loops included) dense, MAGE, MAGE(probs),
# FlashBlock, FlashBlock + MAGE, batch 1 then 4
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 130 python -m pytest -m gpu -q -p no:cacheprovider -n 4 --dist load -rfEs --durations=8 tests/test_mage.py \
    tests/test_policy_rows.py > /tmp/r/gpu_tests_d.txt 2>&1
echo "pytest rc $?"; grep -v "Warn\|warn(" /tmp/r/gpu_tests_d.txt | grep -E "passed|failed|FAILED|Error" | tail -8
export XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
for b in 1 4; do
timeout 215 python -m benchmarks.throughput --sections mage128k --long-batches $b --long-methods mage mage/probs \
    flashblock flashblock+mage --budget-s 185 --tag _issue40_s22d_cb$b --out /tmp/r > /tmp/r/bench_d$b.txt 2>&1
echo "bench rc $?"; grep -v "Warn\|warn(" /tmp/r/bench_d$b.txt | grep "^|" | grep -v "^| \`" | tail -6
done
