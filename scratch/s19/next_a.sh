# next session, call A: every GPU test, spread test by test over 4 workers (--dist load: with loadfile the 99 GPU tests
# of test_kernels.py ran on one worker and two calls of session 19 ran out of time), the openai-client file excluded
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 520 python -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/test_serve_http.py -n 4 --dist load -rfEs \
    --durations=15 > /tmp/r/gpu_tests_a.txt 2>&1; grep -v "Warn\|warn(" /tmp/r/gpu_tests_a.txt | tail -30
