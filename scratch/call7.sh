# session 11 call 7: issue 42 with W8A8 from 128 rows: accuracy of the quantized models (trained at 1k; 8B shapes at 64 tokens)
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p /tmp/r
trap 'tar czf $OUT/r.tgz -C /tmp/r .' EXIT
timeout 120 python -m benchmarks.quantization --parts trained --models checkpoints/tiny-sdar-tasks,checkpoints/tiny-llada-tasks \
    --contexts 1024 --out /tmp/r --tag _issue42c_tasks 2>&1 | grep "^|" | tail -20
timeout 110 python -m benchmarks.quantization --parts shapes --tokens 64 --out /tmp/r --tag _issue42c_shapes64 2>&1 | grep "^|" | tail -8
