# serving_gpu.sh -- issue 41's load generator at SDAR-8B shapes (random weights), server vs lockstep
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=.:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false
python -c "import fastapi, uvicorn, prometheus_client, httpx; print('serve deps ok')"
nvidia-smi --query-gpu=name --format=csv,noheader
timeout ${T:-520} python -m benchmarks.serving --model sdar-8b-chat --rates ${RATES:-4,16} --requests ${N:-48} --slots 16 \
    --prompt-lengths 512:2048 --output-lengths 32:512 --seconds 150 --out $OUT --tag 8b 2>&1 | grep -v Warning | tail -25
