# session 21, call A (issue 40): (1) the GPU tests of bf8027c's kernels and policies; (2) layer_states.patch (one
# policy state per layer through a block's forwards) applied, then dense, MAGE and MAGE(probs) at 128k, batch 1 with
# the optimized HLO dumped (which ops launch the memcpys left), then batch 4
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r /tmp/dump; mkdir -p /tmp/r /tmp/dump
trap 'cd /tmp/dump && ls -S *after_optimizations.txt | head -6 | tar czf $OUT/hlo.tgz -T - ; tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 150 python -m pytest -m gpu -q -p no:cacheprovider -n 4 --dist load -rfEs tests/test_flashblock.py \
    tests/test_mage.py tests/test_policy_rows.py tests/test_kernels.py \
    -k "not TestKernelsGPU or gather or logits or probs or scores" \
    > /tmp/r/gpu_tests_a.txt 2>&1; echo "pytest rc $?"; grep -v "Warn\|warn(" /tmp/r/gpu_tests_a.txt | tail -4
patch -p1 < scratch/s20/layer_states.patch || exit 1
XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$" \
    timeout 200 python -m benchmarks.throughput --sections mage128k --long-batches 1 --long-methods mage mage/probs \
    --budget-s 170 --tag _issue40_s21a1 --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -5
timeout 200 python -m benchmarks.throughput --sections mage128k --long-batches 4 --long-methods mage mage/probs \
    --budget-s 170 --tag _issue40_s21a4 --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -5
