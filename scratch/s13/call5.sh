# session 13 call 5: issue 41 serving diagnosis: where the engine thread's time goes at 16 req/s (128 requests), overlap off / on
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=.:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 560 python -m benchmarks.serving --model sdar-8b-chat --rates 16 --requests 128 --slots 16 \
    --prompt-lengths 512:2048 --output-lengths 32:512 --seconds 150 --overlap both --out /tmp/r --tag 8b_diag 2>&1 \
    | grep -v Warning | tail -22
