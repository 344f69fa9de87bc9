# session 14 call 2 (issue 41): the same trace with while loops / conditionals in command buffers, overlap off / on
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=.:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL"
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 450 python -m benchmarks.serving --model sdar-8b-chat --rates 16 --requests 128 --slots 16 \
    --prompt-lengths 512:2048 --output-lengths 32:512 --seconds 150 --overlap both --no-lockstep --out /tmp/r \
    --tag 8b_s14_overlap_cb 2>&1 | grep -v Warning | tail -24
