# call C: issue 40 (dense, MAGE with its scores from logits behind a barrier, MAGE from keys; batch 4 then 1), then every
# GPU test (issue 38), 4 workers on the one GPU (the openai-client file excluded: no openai here)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 260 python -m benchmarks.throughput --sections mage128k --long-batches 4 1 --long-methods mage mage/keys \
    --budget-s 225 --tag _issue40_s19c --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -8
timeout 310 python -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/test_serve_http.py -n 4 --dist loadfile -rfEs \
    > /tmp/r/gpu_tests_c.txt 2>&1; tail -12 /tmp/r/gpu_tests_c.txt
