# session 17, call E (issues 42 / 38): SDAR-8B batch 1, 1k prompt, bf16 then int8 (one process each, same machine),
# the default XLA flags: the H200's int8 ratio (the README's 1.52x is H100) and issue 38's throughput point
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
for m in bf16 int8; do
  q=""; [ $m = int8 ] && q="--quantize int8"
  timeout 110 python -m benchmarks.throughput --sections sdar --sdar-prompts 1024 --sdar-batches 1 \
      --budget-s 100 --out /tmp/r --tag _s17_sdar_$m $q 2>&1 | grep -v "Warn\|warn(" | grep "^| 1024\|skipped\|Error" \
      | sed "s/^/$m /" | tail -2
done
