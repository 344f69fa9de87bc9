# session 14 call 5 (issue 41): profile of one slot-engine step against lockstep blocks
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 400 python scratch/s14/profile_step.py /tmp/r 2>&1 | grep -v "Warn\|warn(" | tail -90
