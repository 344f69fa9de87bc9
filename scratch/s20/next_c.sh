# next session (issue 40): A/B of one state entry per layer through a block's forwards (layer_states.patch: the
# hypothesis that MAGE's ~300-440 memcpy launches per block are its layers' slices of the stacked policy state) in one
# call: MAGE and dense at 128k, batch 1 then 4, before and after `patch -p1`
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
for tag in before after; do
    [ $tag = after ] && patch -p1 < scratch/s20/layer_states.patch
    timeout 230 python -m benchmarks.throughput --sections mage128k --long-batches 1 4 --long-methods mage \
        --budget-s 200 --tag _issue40_s21_$tag --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -5
done
