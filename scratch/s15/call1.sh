# session 15 call 1 (issue 38): the whole `pytest -m gpu`, then SDAR-8B batch 1 (1k prompt) and LLaDA-8B dual cache
# (1:256:64), bf16, as throughput points against session 12-14's (SDAR 155-156 tok/s, LLaDA dual 401-402 tok/s)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python -m pytest -m gpu -q -n 3 --dist loadfile -p no:cacheprovider --junitxml=/tmp/r/gpu.xml \
    --durations=10 -rfE tests > /tmp/r/gpu_tests.log 2>&1; echo "gpu tests rc=$?"
grep -v "Warning\|warn(" /tmp/r/gpu_tests.log | tail -30
timeout 230 python -m benchmarks.throughput --sections sdar,llada --sdar-prompts 1024 --sdar-batches 1 \
    --llada-runs 1:256:64 --llada-caches dual --budget-s 200 --out /tmp/r --tag _issue38_s15 2>&1 \
    | grep -v "Warn\|warn(" | grep "^|\|skipped\|Error" | tail -20
