# session 22, call A (issue 40): MAGE(select_after_forward) at 128k batch 1 against dense and MAGE in the same call,
# then the GPU tests of session 21's code (LayerStates, the top-k kernel, the batched selection)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 190 python -m benchmarks.throughput --sections mage128k --long-batches 1 --long-methods mage mage/after \
    mage/after+kernel mage/after+probs --budget-s 160 --tag _issue40_s22a1 --out /tmp/r > /tmp/r/bench_a1.txt 2>&1
echo "bench rc $?"; grep -v "Warn\|warn(" /tmp/r/bench_a1.txt | grep "^|" | grep -v "^| \`" | tail -6
grep -B2 -A12 "Traceback" /tmp/r/bench_a1.txt | tail -30
timeout 330 python -m pytest -m gpu -q -p no:cacheprovider -n 4 --dist load -rfEs tests/test_flashblock.py \
    tests/test_policy_rows.py tests/test_gpu.py tests/test_mage.py tests/test_select.py tests/test_kernels.py \
    -k "not TestKernelsGPU or gather or probs or logits" > /tmp/r/gpu_tests_a.txt 2>&1
echo "pytest rc $?"; grep -v "Warn\|warn(" /tmp/r/gpu_tests_a.txt | grep -E "passed|failed|FAILED|Error" | tail -12
