# llada_long1.sh -- issue 39 LLaDA warm starts: A = tiny-llada-tasks regrouped 8x32 -> 4x64, B = small-64 from scratch
export PYTHONPATH=.
T=passkey,sanity,niah_multikey,niah_multikey,niah_multikey,variable_tracking,variable_tracking,variable_tracking
C="--family llada --export-dtype bfloat16 --task $T --steps 20000 --warmup 100 --stratified-t --data-workers 4"
tr_() { XLA_PYTHON_CLIENT_MEM_FRACTION=${FRAC:-0.3} python -m dllm_jax.train $C "$@" --no-progress 2>&1 | grep -v "Warning\|warn(" | tail -3; }
keep() { mkdir -p $OUT/$1 && cp /tmp/$1/hf/* /tmp/$1/history.json /tmp/$1/train_config.json $OUT/$1/; }
cells() { XLA_PYTHON_CLIENT_PREALLOCATE=false python scratch/eval_cells.py $OUT/$1 $OUT/$1/cells.jsonl "${@:2}" 2>&1 | grep CELL | cut -c1-220; }
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
(
  FRAC=0.6 tr_ --init checkpoints/tiny-llada-tasks --regroup-heads 4 --context 64,64,128,256 --batch 512 --lr 5e-4 \
      --max-minutes ${A1MIN:-3} --seed 21 --out /tmp/A1 && keep A1 && cells A1 passkey:256:5:20 niah_multikey:256:5:20 variable_tracking:256:5:20
  FRAC=0.6 tr_ --init /tmp/A1/hf --context 64,128,256,512,1024,1024 --batch 128 --lr 3e-4 --max-minutes ${A2MIN:-3} --seed 22 \
      --out /tmp/A2 && keep A2 && cells A2 passkey:1024:5:20 niah_multikey:1024:5:20 variable_tracking:1024:5:20 variable_tracking:256:5:20
) &
(
  tr_ --config small-64 --niah-needles 2 --vt-hops 0 --context 64,64,64,128 --batch 512 --lr 1e-3 \
      --max-minutes ${BMIN:-7} --seed 23 --out /tmp/B1 && keep B1 && cells B1 niah_multikey:128:5:20 variable_tracking:128:5:20 passkey:128:5:20
) &
wait
for r in A1 A2 B1; do python - $r <<'PY'
import json, sys
h = json.load(open(f"{__import__('os').environ['OUT']}/{sys.argv[1]}/history.json"))
h = h["steps"] if isinstance(h, dict) else h
l = [x["loss"] for x in h]
print(sys.argv[1], "steps", len(l), "loss first100 %.4f last100 %.4f" % (sum(l[:100]) / len(l[:100]), sum(l[-100:]) / len(l[-100:])))
PY
done
