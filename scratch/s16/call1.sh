# next session, call B (issue 41): the 128-request trace with the clients in a process of their own (lockstep in
# the same run), then with the clients in the server's process as sessions 12-14 measured (no lockstep)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=.:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
run() {  # tag, seconds, extra flags
  timeout $2 python -m benchmarks.serving --model sdar-8b-chat --rates 16 --requests 128 --slots 16 \
    --prompt-lengths 512:2048 --output-lengths 32:512 --seconds 150 --out /tmp/r --tag $1 ${@:3} 2>&1 \
    | grep -v Warning | grep "^|" | tail -8
}
run 8b_s16_clients_process 330
run 8b_s16_clients_thread 240 --clients thread --no-lockstep
