# session 13 call 7: issue 41 serving diagnosis with while loops / conditionals in CUDA-graph command buffers (every jit of
# the process), 16 req/s, 128 requests, overlap off / on
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=.:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 330 python -m benchmarks.serving --model sdar-8b-chat --rates 16 --requests 128 --slots 16 \
    --prompt-lengths 512:2048 --output-lengths 32:512 --seconds 150 --overlap both --no-lockstep --out /tmp/r --tag 8b_diag_cb 2>&1 \
    | grep -v Warning | tail -22
