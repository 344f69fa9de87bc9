# session 12 call 3: SDAR-8B batch-1 generation by split-KV's MIN_TILES_PER_SPLIT (bf16, int8); GPU tests of the kernels and quantize
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 170 python scratch/s12/e2e_probe.py bf16 8:0 5:0 2:0 1:0 > /tmp/r/e2e3_bf16.log 2>&1; grep "^|\|rror" /tmp/r/e2e3_bf16.log | tail -5
timeout 150 python scratch/s12/e2e_probe.py int8 5:0 1:0 > /tmp/r/e2e3_int8.log 2>&1; grep "^|\|rror" /tmp/r/e2e3_int8.log | tail -4
timeout 240 python -m pytest -q -m gpu tests/test_quantize.py tests/test_kernels.py -x -p no:cacheprovider > /tmp/r/gpu_tests.log 2>&1; tail -4 /tmp/r/gpu_tests.log
