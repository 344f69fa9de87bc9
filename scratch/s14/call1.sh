# session 14 call 1 (issue 41): 128 requests at 16 req/s, overlap off / on (dispatch thread), lockstep, no XLA flag
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=.:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 570 python -m benchmarks.serving --model sdar-8b-chat --rates 16 --requests 128 --slots 16 \
    --prompt-lengths 512:2048 --output-lengths 32:512 --seconds 150 --overlap both --out /tmp/r --tag 8b_s14_overlap 2>&1 \
    | grep -v Warning | tail -24
