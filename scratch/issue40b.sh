export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 100 python -m pytest -q -m gpu tests/test_kernels.py -k "kv_scores or split_kv" 2>&1 | tail -3
SKIP_TOPK=1 POLICIES=dense,mage/sort timeout 200 python scratch/profile_mage.py sdar-8b-chat 131072 /tmp/ptr 2>&1 | grep -v "Warn\|warn(" | tail -34
XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,CONDITIONAL,WHILE" SKIP_TOPK=1 POLICIES=mage/sort timeout 150 python scratch/profile_mage.py sdar-8b-chat 131072 /tmp/ptr2 2>&1 | grep -v "Warn\|warn(" | tail -18
