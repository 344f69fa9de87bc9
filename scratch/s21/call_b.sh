# session 21, call B (issue 40): the top-k kernel's GPU tests, the top k alone (kernel vs tiles), then MAGE with
# its top k by the kernel in the loop at 128k, batch 1 then 4, against dense and MAGE (LayerStates committed)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider -rfEs tests/test_select.py > /tmp/r/gpu_tests_b.txt 2>&1
echo "pytest rc $?"; grep -v "Warn\|warn(" /tmp/r/gpu_tests_b.txt | grep -E "passed|failed|Error|error" | tail -8
timeout 90 python scratch/s21/topk_time.py 2>&1 | grep -E "^\||Error" | tail -6
for b in 1 4; do
timeout 200 python -m benchmarks.throughput --sections mage128k --long-batches $b --long-methods mage mage/kernel \
    mage/kernel+probs --budget-s 170 --tag _issue40_s21b$b --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" \
    | grep -v "^| \`" | tail -5
done
