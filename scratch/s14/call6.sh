# session 14 call 6 (issue 41): the same profile, its traces returned (GPU timeline of one engine step, lockstep blocks)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 400 python scratch/s14/profile_step.py /tmp/r sdar-8b-chat /tmp/r 2>&1 | grep -v "Warn\|warn(" | grep -v "^ "
for t in t_engine t_l16 t_l80; do f=$(find /tmp/r/$t -name "*.trace.json.gz" | head -1); [ -n "$f" ] && cp $f $OUT/$t.trace.json.gz; done
ls -la $OUT
