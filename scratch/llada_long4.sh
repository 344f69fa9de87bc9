# llada_long4.sh -- issue 39 LLaDA LL4 (16k, decayed rate) beside the GPU tests of the head-major attention change
export PYTHONPATH=.
T10=passkey,sanity,niah_multikey,niah_multikey,niah_multikey,variable_tracking,variable_tracking,variable_tracking,variable_tracking,variable_tracking
C="--family llada --export-dtype bfloat16 --task $T10 --warmup 20 --stratified-t --data-workers 4"
keep() { mkdir -p /tmp/keep/$1 && cp /tmp/$1/hf/* /tmp/$1/history.json /tmp/$1/train_config.json /tmp/keep/$1/ && tar -C /tmp/keep -cf $OUT/$1.tar $1; }
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
(XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 270 python -m pytest -m gpu -q -p no:cacheprovider tests/test_attention.py \
   tests/test_gpu.py tests/test_dream.py tests/test_llada2.py tests/test_kernels.py 2>&1 | tail -15 > /tmp/gputests.log) &
XLA_PYTHON_CLIENT_MEM_FRACTION=0.55 python -m dllm_jax.train $C --init runs/llada3/LL3 --steps 900 --lr 1e-4 \
    --context 1024,4096,8192,16384,16384,16384,16384 --batch 8 --max-minutes 3.4 --seed 27 --out /tmp/LL4 --no-progress \
    2>&1 | grep -v "Warning\|warn(" | tail -2
keep LL4
wait
cat /tmp/gputests.log
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 40 python scratch/eval_cells.py /tmp/keep/LL4 $OUT/cells_LL4.jsonl \
    variable_tracking:16384:7:20 niah_multikey:16384:7:20 2>&1 | grep CELL | cut -c1-200
python - <<'PY'
import json
l = [x["loss"] for x in json.load(open("/tmp/keep/LL4/history.json"))["steps"]]
print("LL4 steps", len(l), " ".join("%.4f" % (sum(l[i:i + 150]) / len(l[i:i + 150])) for i in range(0, len(l), 150)))
PY
