# next session, call B (issue 38): every GPU test, 4 workers on the one GPU (openai-client file excluded)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 500 python -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/test_serve_http.py -n 4 --dist loadfile -rfEs \
    > /tmp/r/gpu_tests_b.txt 2>&1; tail -8 /tmp/r/gpu_tests_b.txt
