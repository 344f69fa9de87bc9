#!/bin/bash
# session 24 call B: do XLA's exhaustive GEMM tile search / autotune levels find faster weight-only 1-byte GEMMs at 4 rows?
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
export PROBE_VARIANTS="bf16,int8 xla,fp8 xla"
echo "== default" | tee /tmp/r/b.log
timeout 150 python scratch/s24/gemv_probe.py 4 2>&1 | grep -A40 SUMMARY | tee -a /tmp/r/b.log
echo "== exhaustive" | tee -a /tmp/r/b.log
XLA_FLAGS="--xla_gpu_exhaustive_tiling_search=true --xla_gpu_dump_autotune_results_to=/tmp/r/autotune_exhaustive.textproto" \
  timeout 330 python scratch/s24/gemv_probe.py 4 2>&1 | grep -A40 "SUMMARY\|rror" | tee -a /tmp/r/b.log
ls -la /tmp/r
