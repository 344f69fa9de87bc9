#!/bin/bash
# session 24 call A: weight-only 1-byte GEMM forms at decode rows (issue 42)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name,memory.total --format=csv | tee /tmp/r/gpu.txt
timeout 520 python scratch/s24/gemv_probe.py 4 32 2>&1 | grep -v "^WARNING\|^I0000\|^E0000" | tee /tmp/r/gemv_probe.log | tail -80
