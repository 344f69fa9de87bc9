# session 20, call D (issue 40): the GPU tests of the final code (MAGE, FlashBlock, per-row policies, the gathered
# kernel), then dense and MAGE at 128k, batch 4 then 1, again (a second sample of call C's code)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider -n 4 --dist load -rfEs tests/test_flashblock.py \
    tests/test_mage.py tests/test_policy_rows.py tests/test_kernels.py -k "not TestKernelsGPU or gather" \
    > /tmp/r/gpu_tests_d.txt 2>&1; echo "pytest rc $?"; grep -v "Warn\|warn(" /tmp/r/gpu_tests_d.txt | tail -4
timeout 230 python -m benchmarks.throughput --sections mage128k --long-batches 4 1 --long-methods mage \
    --budget-s 200 --tag _issue40_s20d --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -7
