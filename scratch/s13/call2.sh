# session 13 call 2: issue 41 serving at SDAR-8B shapes, 128 requests, chunked width inserts, overlap off and on
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=.:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
python -c "import fastapi, uvicorn, prometheus_client, httpx; print('serve deps ok')"
nvidia-smi --query-gpu=name --format=csv,noheader
rm -rf /tmp/r; mkdir -p /tmp/r
timeout 570 python -m benchmarks.serving --model sdar-8b-chat --rates 4,16 --requests 128 --slots 16 \
    --prompt-lengths 512:2048 --output-lengths 32:512 --seconds 150 --overlap both --out /tmp/r --tag 8b 2>&1 \
    | grep -v Warning | tail -30
