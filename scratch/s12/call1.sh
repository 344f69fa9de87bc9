# session 12 call 1: the Pallas quantized GEMV sweep; a kernel profile of SDAR-8B batch-1 generation (int8)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
timeout 380 python scratch/s12/gemv_sweep.py > /tmp/r/sweep.log 2>&1; tail -45 /tmp/r/sweep.log | grep -v "^{"
timeout 180 python scratch/s12/profile_forward.py int8 > /tmp/r/prof_int8.log 2>&1; grep -A42 "^==" /tmp/r/prof_int8.log || tail -5 /tmp/r/prof_int8.log
