# gpu_tests.sh -- the whole `pytest -m gpu` on the device, 3 workers (whole files each), junit to $OUT
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${T:-540} python -m pytest -m gpu -q -n 3 --dist loadfile -p no:cacheprovider --junitxml=$OUT/gpu.xml \
    --durations=15 ${FILES:-tests} 2>&1 | grep -v "Warning\|warn(" | tail -60
