# llada_long3.sh -- issue 39 LLaDA: one more 16k run from runs/llada2/LL2
export PYTHONPATH=.
T10=passkey,sanity,niah_multikey,niah_multikey,niah_multikey,variable_tracking,variable_tracking,variable_tracking,variable_tracking,variable_tracking
C="--family llada --export-dtype bfloat16 --task $T10 --steps 2000 --warmup 20 --stratified-t --data-workers 4"
tr_() { XLA_PYTHON_CLIENT_MEM_FRACTION=0.75 python -m dllm_jax.train $C "$@" --no-progress 2>&1 | grep -v "Warning\|warn(" | tail -2; }
keep() { mkdir -p /tmp/keep/$1 && cp /tmp/$1/hf/* /tmp/$1/history.json /tmp/$1/train_config.json /tmp/keep/$1/ && tar -C /tmp/keep -cf $OUT/$1.tar $1; }
cells() { XLA_PYTHON_CLIENT_PREALLOCATE=false python scratch/eval_cells.py /tmp/keep/$1 $OUT/cells_$1.jsonl "${@:2}" 2>&1 | grep CELL | cut -c1-200; }
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
tr_ --init runs/llada2/LL2 --context 1024,4096,8192,16384,16384,16384 --batch 8 --lr 1.5e-4 \
    --max-minutes ${L3MIN:-6.6} --seed 26 --out /tmp/LL3 && keep LL3
timeout ${EVMIN:-70} bash -c "$(declare -f cells); cells LL3 variable_tracking:16384:6:20 niah_multikey:16384:6:20 passkey:16384:6:20 variable_tracking:8192:6:20 variable_tracking:4096:6:20"
python - <<'PY'
import json
l = [x["loss"] for x in json.load(open("/tmp/keep/LL3/history.json"))["steps"]]
print("LL3 steps", len(l), " ".join("%.4f" % (sum(l[i:i + 200]) / len(l[i:i + 200])) for i in range(0, len(l), 200)))
PY
