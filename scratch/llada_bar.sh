# llada_bar.sh -- issue 39's bar on LLaDA candidates: 3 tasks x 1k/4k/8k/16k x 2 fresh seeds x 50 samples (100 per cell)
export PYTHONPATH=.
CELLS=""
for seed in 11 12; do for ctx in 16384 8192 4096 1024; do for t in variable_tracking niah_multikey passkey; do
  CELLS="$CELLS $t:$ctx:$seed:50"; done; done; done
for r in ${RUNS:-runs/llada6/LL6b runs/llada7/LL7a}; do
  n=$(basename $r)
  timeout ${TB:-165} python scratch/eval_cells.py $r $OUT/bar_$n.jsonl $CELLS 2>&1 | grep CELL | cut -c1-160
done
