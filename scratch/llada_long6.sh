# llada_long6.sh -- issue 39 LLaDA from runs/llada5/LL5, two runs sharing the GPU: a = same RoPE base (1e4),
# b = base raised to 5e5 (--rope-theta with --init); then 16k / 8k / 1k cells of both
export PYTHONPATH=.
T9=passkey,sanity,niah_multikey,variable_tracking,variable_tracking,variable_tracking,variable_tracking,variable_tracking,variable_tracking
C="--family llada --export-dtype bfloat16 --task $T9 --warmup 20 --stratified-t --min-t 0.5 --data-workers 4 --batch 8"
keep() { mkdir -p /tmp/keep/$1 && cp /tmp/$1/hf/* /tmp/$1/history.json /tmp/$1/train_config.json /tmp/keep/$1/ && tar -C /tmp/keep -cf $OUT/$1.tar $1; }
tr_() { XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 python -m dllm_jax.train $C "$@" --no-progress 2>&1 | grep -v "Warning\|warn(" | tail -2; }
(tr_ --init runs/llada5/LL5 --steps 2000 --lr 6e-5 --context 1024,4096,8192,16384,16384,16384,16384 \
     --max-minutes ${MIN:-6} --seed 29 --out /tmp/LL6a && keep LL6a) &
(tr_ --init runs/llada5/LL5 --rope-theta 500000 --steps 2000 --lr 1e-4 --context 1024,4096,8192,16384,16384,16384 \
     --max-minutes ${MIN:-6} --seed 30 --out /tmp/LL6b && keep LL6b) &
wait
for r in LL6a LL6b; do
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 100 python scratch/eval_cells.py /tmp/keep/$r $OUT/cells_$r.jsonl \
      variable_tracking:16384:9:40 niah_multikey:16384:9:40 variable_tracking:8192:9:20 variable_tracking:1024:9:20 \
      2>&1 | grep CELL | cut -c1-200
done
