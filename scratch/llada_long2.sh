# llada_long2.sh -- issue 39 LLaDA length curriculum from runs/llada1/A1 (regrouped 4x64, trained <= 256 tokens)
export PYTHONPATH=.
T10=passkey,sanity,niah_multikey,niah_multikey,niah_multikey,variable_tracking,variable_tracking,variable_tracking,variable_tracking,variable_tracking
C="--family llada --export-dtype bfloat16 --task $T10 --steps 2000 --warmup 20 --stratified-t --data-workers 4"
tr_() { XLA_PYTHON_CLIENT_MEM_FRACTION=0.75 python -m dllm_jax.train $C "$@" --no-progress 2>&1 | grep -v "Warning\|warn(" | tail -2; }
keep() { mkdir -p /tmp/keep/$1 && cp /tmp/$1/hf/* /tmp/$1/history.json /tmp/$1/train_config.json /tmp/keep/$1/ && tar -C /tmp/keep -cf $OUT/$1.tar $1; }
cells() { XLA_PYTHON_CLIENT_PREALLOCATE=false python scratch/eval_cells.py /tmp/keep/$1 $OUT/cells_$1.jsonl "${@:2}" 2>&1 | grep CELL | cut -c1-200; }
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
tr_ --init runs/llada1/A1 --max-positions 32768 --context 256,1024,2048,4096,4096 --batch 32 --lr 2e-4 \
    --max-minutes ${L1MIN:-3.3} --seed 24 --out /tmp/LL1 && keep LL1
cells LL1 passkey:4096:5:20 niah_multikey:4096:5:20 variable_tracking:4096:5:20 variable_tracking:1024:5:20 &
tr_ --init /tmp/LL1/hf --context 1024,4096,8192,16384,16384 --batch 8 --lr 2e-4 \
    --max-minutes ${L2MIN:-3.3} --seed 25 --out /tmp/LL2 && keep LL2
wait
timeout ${EVMIN:-75} bash -c "$(declare -f cells); cells LL2 variable_tracking:16384:5:12 niah_multikey:16384:5:12 passkey:16384:5:12 variable_tracking:8192:5:12"
for r in LL1 LL2; do python - $r <<'PY'
import json, sys
h = json.load(open(f"/tmp/keep/{sys.argv[1]}/history.json"))["steps"]
l = [x["loss"] for x in h]
print(sys.argv[1], "steps", len(l), "loss first50 %.4f last50 %.4f" % (sum(l[:50]) / len(l[:50]), sum(l[-50:]) / len(l[-50:])))
PY
done
ls -la $OUT
