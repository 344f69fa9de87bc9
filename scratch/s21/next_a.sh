# next session, call A (issue 40): MAGE with every layer's top k in one batched selection after the block's first
# forward (select_after_forward, built in session 21, CPU-tested only), its GPU tests first, then at 128k against
# dense and MAGE in the same call, batch 1 then 4 (expect ~600 fewer launches per block at batch 1)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 200 python -m pytest -m gpu -q -p no:cacheprovider -n 4 --dist load -rfEs tests/test_flashblock.py \
    tests/test_policy_rows.py tests/test_gpu.py tests/test_mage.py > /tmp/r/gpu_tests_a.txt 2>&1
echo "pytest rc $?"; grep -v "Warn\|warn(" /tmp/r/gpu_tests_a.txt | grep -E "passed|failed|FAILED|Error" | tail -8
for b in 1 4; do
timeout 170 python -m benchmarks.throughput --sections mage128k --long-batches $b --long-methods mage mage/after mage/after+kernel \
    mage/after+probs --budget-s 150 --tag _issue40_s22a$b --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" \
    | grep -v "^| \`" | tail -4
done
