nvidia-smi --query-gpu=name --format=csv,noheader
RUNS=runs/llada7/LL7a TB=170 bash scratch/llada_bar.sh
bash scratch/gpu_final.sh
