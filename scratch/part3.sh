# part3.sh CTX TASKS TAG [METHODS] -- one issue-39 part-3 quality x speed run into $OUT
# MODEL (default checkpoints/tiny-sdar-long), LIMIT (seconds, default 540), DIAG (diagnostics samples, default 1),
# BATCH (prompts per generate call, default all)
CTX=$1; TASKS=$2; TAG=$3; METHODS=${4:-}
MODEL=${MODEL:-checkpoints/tiny-sdar-long}
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout ${LIMIT:-540} python -m benchmarks.quality --models $MODEL --contexts $CTX --samples 100 \
    --seed 71 --tasks $TASKS --diagnostics ${DIAG:-1} --time-repeats 2 --out $OUT --tag $TAG ${BATCH:+--batch-size $BATCH} ${METHODS:+--methods $METHODS} \
    2>&1 | grep -v "Warning\|warn(" | tail -60
echo "rc=$?"; ls -la $OUT
