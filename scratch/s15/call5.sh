# session 15 call 5 (issue 41): serving_step again with the lockstep block kernel by kernel and both rows by class
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m benchmarks.serving_step --model sdar-8b-chat --slots 16 --prompt-lengths 512:2048 \
    --out $OUT --tag 8b_s15_kernels 2>&1 | grep -v "Warn\|warn(" | tail -45
