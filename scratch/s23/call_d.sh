# session 23, call D (issues 40 and 42): the split-KV combine kernel as one program per query row (the whole merge in
# one step at SDAR-8B's 33 splits, batch 1, 128k; session 22's kernel took 5 sequential steps: 11 us a call there)
# against XLA's merge (split_kv_combine_reference) in one call: GPU tests first, then SDAR-8B batch 1 at 1k (bf16)
# and mage128k batch 1 (dense, MAGE), each with its profile
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python -m pytest -m gpu -q -p no:cacheprovider -n 4 --dist load -rfEs -x tests/test_kernels.py \
    -k "split_kv or gather or combine or long_bf16" > /tmp/r/gpu_tests_kernels.txt 2>&1
echo "kernels rc $?"; grep -v "Warn\|warn(" /tmp/r/gpu_tests_kernels.txt | grep -E "passed|failed|FAILED|Error" | tail -8
bench() {  # $1: tag suffix
  timeout 70 python -m benchmarks.throughput --sections sdar --sdar-prompts 1024 --sdar-batches 1 --method-points \
      --budget-s 50 --out /tmp/r --tag _s23d_${1}_bf16 2>&1 | grep -v "Warn\|warn(" | grep "^| [0-9]\|skipped" | tail -1
  timeout 115 python -m benchmarks.throughput --sections mage128k --long-batches 1 --long-methods mage --budget-s 95 \
      --out /tmp/r --tag _issue40_s23d_${1}_b1 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -2
  grep -h "split_kv_combine\|GPU kernels" /tmp/r/throughput_issue40_s23d_${1}_b1_*.md | head -6
}
bench rows
sed -i 's/    allocated = padded_splits(num_splits, d)$/    allocated = num_splits/; s/    o, lse = split_kv_combine(o, lse, q.shape/    o, lse = split_kv_combine_reference(o, lse, q.shape/' \
    pallas_kernels/split_kv.py && grep -n "allocated = num_splits\|= split_kv_combine_reference(o" pallas_kernels/split_kv.py \
    && bench xla
