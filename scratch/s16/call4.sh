# session 16 call 4: XLA's command buffers off (each while-loop iteration of the block loop updated and launched a
# CUDA graph: ~2.8 ms of device idle per denoising step in call 3's profile). Issue 41's trace, then SDAR-8B batch 1
# (issue 42 / 38 point) with and without, then MAGE / dense at 128k profiled (issue 40)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit
export PYTHONPATH=.:/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false
rm -rf /tmp/r; mkdir -p /tmp/r
trap 'rm -rf /tmp/r/trace_*; tar czf $OUT/r.tgz -C /tmp/r .' EXIT
nvidia-smi --query-gpu=name --format=csv,noheader
OFF="--xla_gpu_enable_command_buffer="
XLA_FLAGS=$OFF timeout 200 python -m benchmarks.serving --model sdar-8b-chat --rates 16 --requests 128 --slots 16 \
    --prompt-lengths 512:2048 --output-lengths 32:512 --seconds 150 --out /tmp/r --tag 8b_s16_cb_off 2>&1 \
    | grep -v Warning | grep "^|" | tail -8
for v in "bf16 default" "bf16 off" "int8 off"; do
  set -- $v
  q=""; [ $1 = int8 ] && q="--quantize int8"
  f=""; [ $2 = off ] && f=$OFF
  XLA_FLAGS=$f timeout 95 python -m benchmarks.throughput --sections sdar --sdar-prompts 1024 --sdar-batches 1 \
      --budget-s 85 --out /tmp/r --tag _s16_sdar_$1_cb_$2 $q 2>&1 | grep -v "Warn\|warn(" | grep "^| 1024\|skipped\|Error" \
      | sed "s/^/$1 cb-$2 /" | tail -2
done
XLA_FLAGS=$OFF timeout 100 python scratch/s16/profile_mage.py 131072 /tmp/r 2>&1 | grep -v "Warn\|warn(" \
    | tee /tmp/r/profile_mage_cb_off.txt | grep "==\|->" | head -30
