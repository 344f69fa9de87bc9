# session 20, call B (issue 40): the GPU tests of the changed code (the gathered kernel's in-kernel clamp, MAGE's
# stored list, the split-KV logits' shared memory at 128 query rows), then dense and MAGE at 128k, batch 4 then 1
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider -n 4 --dist load -rfEs tests/test_flashblock.py \
    tests/test_mage.py tests/test_policy_rows.py tests/test_kernels.py -k "not TestKernelsGPU or gather or split_kv or scores or traced" \
    > /tmp/r/gpu_tests_b.txt 2>&1; echo "pytest rc $?"; grep -v "Warn\|warn(" /tmp/r/gpu_tests_b.txt | tail -6
timeout 300 python -m benchmarks.throughput --sections mage128k --long-batches 4 1 --long-methods mage \
    --budget-s 260 --tag _issue40_s20b --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -7
