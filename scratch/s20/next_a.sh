# next session, call A (issue 40): which XLA ops launch MAGE's ~450 memcpy32_post and ~180 memcpy_post kernels per
# block at batch 1 (dense: 7): the optimized HLO of the benchmark's jitted blocks (dense and MAGE), then grep the
# `copy` instructions and in-place updates of the MAGE module against dense's
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r /tmp/dump; mkdir -p /tmp/r /tmp/dump
trap 'cd /tmp/dump && ls -S *after_optimizations.txt | head -4 | tar czf $OUT/hlo.tgz -T - ; tar czf $OUT/r.tgz -C /tmp/r .' EXIT
XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$" \
    timeout 240 python -m benchmarks.throughput --sections mage128k --long-batches 1 --long-methods mage \
    --budget-s 200 --tag _issue40_s21a --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -4
ls -S /tmp/dump | head -8
