# session 21, call C (issue 40): the top-k kernel's GPU tests (list path), its chunk/warps/stages swept alone at 128k,
# then (the sweep's fastest set as the module's defaults on this copy) MAGE with it in the loop, batch 1 then 4
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 100 python -m pytest -m gpu -q -p no:cacheprovider -rfEs tests/test_select.py > /tmp/r/gpu_tests_c.txt 2>&1
echo "pytest rc $?"; grep -v "Warn\|warn(" /tmp/r/gpu_tests_c.txt | grep -E "passed|failed|Error|error" | tail -8
timeout 200 python scratch/s21/topk_sweep.py 2>&1 | grep -E "^\||BEST|Error" | tee /tmp/r/sweep.txt | tail -30
read _ CH W ST < <(grep BEST /tmp/r/sweep.txt)
sed -i "s/^CHUNK = 4096/CHUNK = $CH/; s/^NUM_WARPS = 8/NUM_WARPS = $W/; s/^NUM_STAGES = 1/NUM_STAGES = $ST/" pallas_kernels/top_k.py
grep -E "^(CHUNK|NUM_WARPS|NUM_STAGES) =" pallas_kernels/top_k.py
for b in 1 4; do
timeout 170 python -m benchmarks.throughput --sections mage128k --long-batches $b --long-methods mage mage/kernel \
    mage/kernel+probs --budget-s 150 --tag _issue40_s21c$b --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" \
    | grep -v "^| \`" | tail -4
done
