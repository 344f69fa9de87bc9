# part3_tar.sh CTX TASKS TAG METHODS -- one issue-39 part-3 run; everything it writes packed into $OUT/results.tgz
# MODEL, LIMIT (s, default 540), DIAG, BATCH as scratch/part3.sh
CTX=$1; TASKS=$2; TAG=$3; METHODS=${4:-}
MODEL=${MODEL:-checkpoints/tiny-llada-long}
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/q
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout ${LIMIT:-540} python -m benchmarks.quality --models $MODEL --contexts $CTX --samples 100 \
    --seed 71 --tasks $TASKS --diagnostics ${DIAG:-1} --time-repeats 2 --out /tmp/q --tag $TAG \
    ${BATCH:+--batch-size $BATCH} ${METHODS:+--methods $METHODS} 2>&1 | grep -v "Warning\|warn(" | tail -40
echo "rc=${PIPESTATUS[0]}"; ls -la /tmp/q
tar czf $OUT/results.tgz -C /tmp/q .
