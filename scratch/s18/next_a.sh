# next session, call A (issue 40): the new kernels' GPU tests first (split-KV logits, kv_scores tiles), then the
# selection benchmark (tiles, kv_scores tiles per program, the pass + scores from logits), then dense and MAGE
# (tile tournament by default) at 128k batch 1 in the loop
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels.py tests/test_select.py tests/test_mage.py \
    > /tmp/r/gpu_tests_a.txt 2>&1; tail -3 /tmp/r/gpu_tests_a.txt
timeout 120 python -m benchmarks.mage_select --lengths 131072 --batches 1 4 --out /tmp/r 2>&1 | grep -v "Warn\|warn(" \
    | grep "^|" | tail -30
timeout 240 python -m benchmarks.throughput --sections mage128k --long-batches 1 --long-methods mage mage/sort \
    --budget-s 200 --tag _issue40_s19a --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -5
