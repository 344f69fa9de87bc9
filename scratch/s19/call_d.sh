# call D (issue 40): the GPU tests of the changed kernels and MAGE (split-KV logits, kv_scores_from_logits' Pallas
# reduction, the tile tournament), then dense, MAGE (scores from the pass's logits) and mage/keys at 128k, batch 4 then 1
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 130 python -m pytest -m gpu -q -p no:cacheprovider -n 4 --dist loadfile -rfEs tests/test_kernels.py \
    tests/test_select.py tests/test_mage.py > /tmp/r/gpu_tests_d.txt 2>&1; grep -v "Warn\|warn(" /tmp/r/gpu_tests_d.txt | tail -6
timeout 235 python -m benchmarks.throughput --sections mage128k --long-batches 4 1 --long-methods mage mage/keys \
    --budget-s 200 --tag _issue40_s19d --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -7
