# session 17, call D (issue 40): the chunked top-k selection; MAGE at 128k batch 1 and 4, the profile
# was gather + flash over the block + LSE merge), the section's batch-4 OOM fixed (the profile held the previous
# method's cache): MAGE at 128k, batch 1 and 4, then the kernel profile of one block, then the gpu tests
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python -m benchmarks.throughput --sections mage128k --long-batches 1 4 --budget-s 280 --tag _issue40_s17c \
    --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -12
mkdir -p /tmp/p; timeout 130 python scratch/s16/profile_mage.py 131072 /tmp/p > /tmp/r/profile_mage_s17.txt 2>&1; cp /tmp/p/*.json /tmp/r/; head -70 /tmp/r/profile_mage_s17.txt | grep -v "^ " ; grep -A14 "== mage" /tmp/r/profile_mage_s17.txt | tail -14
