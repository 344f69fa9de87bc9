# gpu_final.sh -- SDAR-8B batch 1 and LLaDA-8B dual cache throughput: the package before this work (.gpu_base, at
# 110387f) against this checkout, each by its own benchmarks/throughput.py, one after the other; then --compare
export XLA_PYTHON_CLIENT_PREALLOCATE=false
A="--sections sdar,llada --sdar-prompts 1024 --sdar-batches 1 --method-points --llada-runs 1:256:64 --llada-caches dual"
mkdir -p $OUT/base $OUT/new
(cd .gpu_base && PYTHONPATH=. timeout 130 python benchmarks/throughput.py $A --out $OUT/base 2>&1 | tail -4)
PYTHONPATH=. timeout 130 python benchmarks/throughput.py $A --out $OUT/new 2>&1 | tail -4
PYTHONPATH=. python benchmarks/throughput.py --compare $OUT/base/throughput_*.json $OUT/new/throughput_*.json --out $OUT 2>&1 | tail -3
cat $OUT/throughput_compare*.md
