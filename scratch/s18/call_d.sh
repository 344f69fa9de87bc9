# session 18, call D (issues 40, 38): dense and MAGE at 128k, batches 4 and 1, with the top-k chunk of 4096 and
# kv_scores' one tile per program; then every GPU test (openai-client files excluded: no openai on the device)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python -m benchmarks.throughput --sections mage128k --long-batches 4 1 --long-methods mage --budget-s 250 \
    --tag _issue40_s18d --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -8
N=$(python -c "import xdist" 2>/dev/null && echo "-n 4 --dist loadfile"); echo "xdist: ${N:-none}"
timeout 220 python -m pytest -m gpu -q -p no:cacheprovider --ignore=tests/test_serve_http.py $N -rfE \
    > /tmp/r/gpu_tests_d.txt 2>&1; tail -5 /tmp/r/gpu_tests_d.txt
