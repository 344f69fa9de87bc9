# session 15 call 3 (issue 41): one engine step against one lockstep block (benchmarks/serving_step.py, first GPU run),
# SDAR-8B random bf16, 16 busy slots, prompts 512-2048: as the server runs now, then with while loops / conditionals in
# command buffers
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=.:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 280 python -m benchmarks.serving_step --model sdar-8b-chat --slots 16 --prompt-lengths 512:2048 \
    --out /tmp/r --tag 8b_s15 2>&1 | grep -v "Warn\|warn(" | tail -40
XLA_FLAGS="--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" timeout 250 python -m benchmarks.serving_step \
    --model sdar-8b-chat --slots 16 --prompt-lengths 512:2048 --out /tmp/r --tag 8b_s15_cb 2>&1 \
    | grep -v "Warn\|warn(" | tail -40
