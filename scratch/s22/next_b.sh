# next session, call B (issues 40 and 42), after next_a.sh passed: an A/B in one call of session 22's launch cuts:
# this tree (the combine kernel, the kernels folding their own queries, the block's keys read in place) against the
# code before them (session 21's split_kv.py, scratch/s22/split_kv_18e1e4f.py, with the two new names dropped from
# pallas_kernels/__init__.py; mage.py and flashblock.py as of d2fd6f1: MAGE's batched selection kept). SDAR-8B batch 1 at 1k in
# bf16 and int8 (issue 42's row) and mage128k batch 1 (dense, MAGE), each with its profile (launches per block)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
bench() {  # $1: tag suffix
  for q in bf16 int8; do
    flag=""; [ $q != bf16 ] && flag="--quantize $q"
    timeout 80 python -m benchmarks.throughput --sections sdar --sdar-prompts 1024 --sdar-batches 1 --method-points \
        --budget-s 60 --out /tmp/r --tag _s23b_${1}_$q $flag 2>&1 | grep -v "Warn\|warn(" | grep "^| [0-9]\|skipped" | tail -2
  done
  timeout 115 python -m benchmarks.throughput --sections mage128k --long-batches 1 --long-methods mage --budget-s 95 \
      --out /tmp/r --tag _s23b_${1}_mage1 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -3
}
bench new
cp scratch/s22/split_kv_18e1e4f.py pallas_kernels/split_kv.py && sed -i '/split_kv_combine/d' pallas_kernels/__init__.py \
    && sed -i 's/"split_kv_attention", "split_kv_attention_reference",.*/"split_kv_attention", "split_kv_attention_reference",/' \
    pallas_kernels/__init__.py && cp scratch/s22/mage_d2fd6f1.py dllm_jax/attention/mage.py \
    && cp scratch/s22/flashblock_d2fd6f1.py dllm_jax/attention/flashblock.py && python -c "import dllm_jax" && bench old
