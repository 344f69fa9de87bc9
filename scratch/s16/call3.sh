# session 16 call 3: issue 40 (MAGE at 128k: every kernel and the idle gaps by the kernel before them), then issue 41
# (serving_step on an H200, 8 profiled steps)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'rm -rf /tmp/r/trace_*; tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 240 python scratch/s16/profile_mage.py 131072 /tmp/r 2>&1 | grep -v "Warn\|warn(" | tee /tmp/r/profile_mage.txt | tail -150
timeout 230 python -m benchmarks.serving_step --model sdar-8b-chat --slots 16 --prompt-lengths 512:2048 \
    --out /tmp/r --tag 8b_s16 2>&1 | grep -v "Warn\|warn(" | tail -45
