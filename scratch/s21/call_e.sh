# session 21, call E (issue 40): the GPU tests of what changed (LayerStates in SDAR's loop, the top-k kernel, MAGE,
# FlashBlock, per-row policies), then dense, MAGE, MAGE(probs) and MAGE(kernel) at 128k, batch 4 then 1
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 140 python -m pytest -m gpu -q -p no:cacheprovider -n 4 --dist load -rfEs tests/test_flashblock.py \
    tests/test_policy_rows.py tests/test_select.py tests/test_gpu.py tests/test_kernels.py \
    -k "not TestKernelsGPU or gather or probs or logits" > /tmp/r/gpu_tests_e.txt 2>&1
echo "pytest rc $?"; grep -v "Warn\|warn(" /tmp/r/gpu_tests_e.txt | grep -E "passed|failed|FAILED|Error" | tail -8
for b in 4 1; do
timeout 130 python -m benchmarks.throughput --sections mage128k --long-batches $b --long-methods mage mage/probs \
    mage/kernel --budget-s 110 --tag _issue40_s21e$b --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" \
    | grep -v "^| \`" | tail -4
done
