# next session, call A (issue 41): the 128-request trace served by block and by forward (Engine(schedule=)), lockstep
# in the same run; the forwards columns say what each schedule ran against what the rows needed. carry [".whl"]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=.:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 540 python -m benchmarks.serving --model sdar-8b-chat --rates 16 --requests 128 --slots 16 \
    --prompt-lengths 512:2048 --output-lengths 32:512 --seconds 150 --out /tmp/r --tag 8b_s17_schedules \
    --schedules block,forward 2>&1 | grep -v Warning | grep "^|\|compiled" | tail -12
