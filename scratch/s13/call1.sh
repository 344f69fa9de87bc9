# session 13 call 1: GPU tests never run (quantized grouped matmul etc.); quantized GEMMs at 4 / 1024 rows; prefill profiles
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 190 python -m pytest -m gpu -q -p no:cacheprovider tests/test_quantize.py tests/test_llada2.py tests/test_kernels.py \
   -k "quantiz or grouped or split_kv or llada2" -rf > /tmp/r/gpu_tests.log 2>&1; echo "tests rc=$?"; tail -5 /tmp/r/gpu_tests.log
for q in bf16 int8 fp8; do
  timeout 75 python scratch/s13/prefill_profile.py $q 1024 2>&1 | grep -v "Warn\|warn(" | tail -20
done
timeout 170 python -m benchmarks.quantized_gemm --rows 4 1024 --layers 36 --out /tmp/r --tag _s13 2>&1 | grep -v "Warn\|warn(" | grep "^|" | tail -20
