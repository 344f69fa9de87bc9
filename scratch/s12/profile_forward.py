"""Session 12: per-kernel GPU time of one SDAR-8B batch-1 generation (1k prompt, 128 new tokens, 4 steps per
block), bf16 or quantized, to find the part of a forward that does not shrink with the weights."""
import os, sys, tempfile, json
from pathlib import Path
import jax, jax.numpy as jnp
from dllm_jax import generate
from dllm_jax.bench import kernel_profile
from dllm_jax.bench.models import model_for
q = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "bf16" else None
model, config = model_for("sdar-8b-chat", layers=None, context=2048, dtype=jnp.bfloat16, quantize=q)
ids = jax.random.randint(jax.random.key(1), (1, 1024), 0, 1000, jnp.int32)
opts = dict(max_new_tokens=128, denoising_steps=4, remasking="low_confidence_static")
run = lambda: jax.block_until_ready(generate(model, ids, seed=0, **opts))
run(); run()
with tempfile.TemporaryDirectory() as d:
    prof = kernel_profile(run, Path(d), top=40)
forwards = 128 // 4 * 4  # 32 blocks x 4 denoising forwards (+ commit forwards fused)
print(f"== {q or 'bf16'}: GPU kernels {prof['gpu_ms']:.1f} ms, {prof['launches']} launches")
for k in prof["kernels"]:
    print(f"{k['ms']:8.2f} ms {k['launches']:6d}  {k['name']}")
json.dump(prof, open(f"/tmp/r/profile_{q or 'bf16'}.json", "w"), indent=1)
