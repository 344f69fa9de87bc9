# train_next.sh PREV NEXT SEED MINUTES LR CONTEXTS -- one resumed long-context SDAR run, export to $OUT/NEXT, eval
set -e
T9D=passkey,sanity,niah_multikey,variable_tracking,variable_tracking,variable_tracking,variable_tracking,variable_tracking,variable_tracking
PREV=$1; NEXT=$2; SEED=$3; MIN=$4; LR=$5; CTX=$6; T9=${7:-$T9D}
S="--family sdar --export-dtype bfloat16 --task $T9 --vt-hops 1 --vt-ask-back 0,0,1 --min-t 0.5 --stratified-t"
export PYTHONPATH=.
python -m dllm_jax.train $S --init runs/$PREV --context $CTX --batch 8 --steps ${STEPS:-2000} --warmup 20 --lr $LR \
    --max-minutes $MIN --seed $SEED --out /tmp/$NEXT 2>&1 | tr "\r" "\n" | grep -v "Warning\|step/s" | tail -4
mkdir -p $OUT/$NEXT && cp /tmp/$NEXT/hf/* $OUT/$NEXT/ && cp /tmp/$NEXT/train_config.json /tmp/$NEXT/history.json $OUT/$NEXT/ 2>/dev/null || true
ls /tmp/$NEXT /tmp/$NEXT/hf
if [ -n "$CELLS" ]; then python scratch/eval_cells.py $OUT/$NEXT $OUT/$NEXT/cells.jsonl $CELLS 2>&1 | grep CELL | cut -c1-200; fi
