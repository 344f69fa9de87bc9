# session 12 call 2: split-KV at decode shapes by splits; SDAR-8B batch-1 generation under split / GEMV variants
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 150 python scratch/s12/splitkv_probe.py > /tmp/r/splitkv.log 2>&1; grep "^|\|err\|rror" /tmp/r/splitkv.log | tail -22
timeout 150 python scratch/s12/e2e_probe.py bf16 8:0 1:0 > /tmp/r/e2e_bf16.log 2>&1; grep "^|\|equal\|rror" /tmp/r/e2e_bf16.log | tail -5
timeout 220 python scratch/s12/e2e_probe.py int8 8:0 1:0 1:3.4e7 > /tmp/r/e2e_int8.log 2>&1; grep "^|\|equal\|rror" /tmp/r/e2e_int8.log | tail -6
timeout 150 python scratch/s12/e2e_probe.py fp8 1:0 > /tmp/r/e2e_fp8.log 2>&1; grep "^|\|equal\|rror" /tmp/r/e2e_fp8.log | tail -5
