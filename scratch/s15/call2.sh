# session 15 call 2 (issue 38): the whole `pytest -m gpu` (call 1's 330 s limit cut it at ~63%, no failure), 6 workers,
# each test's result line kept
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 560 python -m pytest -m gpu -v -n 6 --dist loadfile -p no:cacheprovider --junitxml=$OUT/gpu.xml \
    --durations=15 -rfE tests > $OUT/gpu_tests.log 2>&1; echo "gpu tests rc=$?"
grep -c PASSED $OUT/gpu_tests.log; grep "FAILED\|ERROR" $OUT/gpu_tests.log | head -20
grep -v "Warning\|warn(\|PASSED" $OUT/gpu_tests.log | tail -30
