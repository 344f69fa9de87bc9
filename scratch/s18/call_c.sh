# session 18, call C (issue 40): kv_scores' tile configuration at 128k, batches 1 and 4 (each checked against the
# default's output), then the GPU tests of the kernels and MAGE files
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 260 python scratch/s18/kv_sweep.py 220 > /tmp/r/kv_sweep.txt 2>&1; grep -v "Warn\|warn(" /tmp/r/kv_sweep.txt | grep "^|\|fail" | tail -24
timeout 100 python -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels.py tests/test_mage.py tests/test_select.py \
    > /tmp/r/gpu_tests_c.txt 2>&1; tail -3 /tmp/r/gpu_tests_c.txt
