# next session, call B (issue 40 + the GPU tests the session-16 changes touch): MAGE at 128k, batch 1 and 4, with the
# static later-step mode (session 16: batch 1 1.12x dense on an H200), then the gpu-marked tests of the changed files
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python -m benchmarks.throughput --sections mage128k --long-batches 1 4 --budget-s 300 --tag _issue40_s17 \
    --out /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep "^|" | grep -v "^| \`" | tail -10
timeout 240 python -m pytest -m gpu -q -p no:cacheprovider tests/test_mage.py tests/test_policy_rows.py \
    tests/test_flashblock.py tests/test_serve_engine.py tests/test_generate_sdar_batch.py 2>&1 | tail -3
