# next session, call A (issues 40 and 42): the GPU tests of session 22's split-KV changes (CPU-tested only): the
# partials merged by one Pallas kernel (pk.split_kv_combine) and the kernels folding their own queries. Every split-KV
# and gathered GPU test goes through both; then the loops that use them (MAGE, FlashBlock, per-row policies, test_gpu)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider -n 4 --dist load -rfEs -x tests/test_kernels.py \
    -k "split_kv or gather or combine or long_bf16" > /tmp/r/gpu_tests_kernels.txt 2>&1
echo "kernels rc $?"; grep -v "Warn\|warn(" /tmp/r/gpu_tests_kernels.txt | grep -E "passed|failed|FAILED|Error" | tail -8
timeout 330 python -m pytest -m gpu -q -p no:cacheprovider -n 4 --dist load -rfEs tests/test_mage.py tests/test_gpu.py \
    tests/test_flashblock.py tests/test_policy_rows.py tests/test_select.py > /tmp/r/gpu_tests_loops.txt 2>&1
echo "loops rc $?"; grep -v "Warn\|warn(" /tmp/r/gpu_tests_loops.txt | grep -E "passed|failed|FAILED|Error" | tail -8
# which kernels one layer launches per forward now (SDAR-8B shapes, 4 layers, batch 1, dense and MAGE): the list
# the next launch cuts start from
timeout 100 python scratch/s22/layer_kernels.py > /tmp/r/layer_kernels.txt 2>&1; echo "layers rc $?"
grep -A3 "^## \|by kind" /tmp/r/layer_kernels.txt | cut -c1-400 | tail -12
