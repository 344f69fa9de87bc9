# llada_long5.sh -- issue 39 LLaDA LL5 (VT 6 in 9, --min-t 0.5, 16k-heavy) beside the small GPU test files
export PYTHONPATH=.
T9=passkey,sanity,niah_multikey,variable_tracking,variable_tracking,variable_tracking,variable_tracking,variable_tracking,variable_tracking
C="--family llada --export-dtype bfloat16 --task $T9 --warmup 20 --stratified-t --min-t 0.5 --data-workers 4"
keep() { mkdir -p /tmp/keep/$1 && cp /tmp/$1/hf/* /tmp/$1/history.json /tmp/$1/train_config.json /tmp/keep/$1/ && tar -C /tmp/keep -cf $OUT/$1.tar $1; }
(XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 280 python -m pytest -m gpu -q -p no:cacheprovider tests/test_attention.py \
   tests/test_gpu.py tests/test_dream.py tests/test_llada2.py -rA 2>&1 | grep -i "passed\|failed\|error" | tail -20 > $OUT/gputests.log) &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.55 python -m dllm_jax.train $C --init runs/llada4/LL4 --steps 1100 --lr 8e-5 \
    --context 4096,8192,16384,16384,16384,16384 --batch 8 --max-minutes 4.6 --seed 28 --out /tmp/LL5 --no-progress \
    2>&1 | grep -v "Warning\|warn(" | tail -2
keep LL5
wait
cat $OUT/gputests.log
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 40 python scratch/eval_cells.py /tmp/keep/LL5 $OUT/cells_LL5.jsonl \
    variable_tracking:16384:8:20 niah_multikey:16384:8:20 2>&1 | grep CELL | cut -c1-200
python - <<'PY'
import json
l = [x["loss"] for x in json.load(open("/tmp/keep/LL5/history.json"))["steps"]]
print("LL5 steps", len(l), " ".join("%.4f" % (sum(l[i:i + 150]) / len(l[i:i + 150])) for i in range(0, len(l), 150)))
PY
