# session 20, call F: the float16 probabilities' kernels (split-KV return_probs, kv_scores_from_probs) on the GPU
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 100 python -m pytest -m gpu -q -p no:cacheprovider tests/test_kernels.py -k "probs" -rfEs 2>&1 | grep -v "Warn\|warn(" | tail -15
