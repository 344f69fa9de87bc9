"""Session 13: SDAR-8B prefill of a 1k prompt at batch 1, bf16 / int8 / fp8: wall time and per-kernel GPU time
(why int8's W8A8 prefill ran 61 ms against bf16's 53 in session 12)."""
import sys, tempfile, json, time
from pathlib import Path
import jax, jax.numpy as jnp
from dllm_jax.bench import kernel_profile
from dllm_jax.bench.models import model_for
from dllm_jax.bench.timing import time_calls
q = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "bf16" else None
n = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
model, config = model_for("sdar-8b-chat", layers=None, context=2048, dtype=jnp.bfloat16, quantize=q)
ids = jax.random.randint(jax.random.key(1), (1, n), 0, 1000, jnp.int32)
run = lambda: jax.block_until_ready(model.prefill(ids, model.init_cache(1, n)))
t0 = time.time(); run(); print("first call", time.time() - t0, flush=True)
ms = time_calls(lambda: run()) * 1e3
with tempfile.TemporaryDirectory() as d:
    prof = kernel_profile(run, Path(d), top=25)
print(f"== {q or 'bf16'} prefill {n}: wall {ms:.2f} ms, GPU kernels {prof['gpu_ms']:.2f} ms, {prof['launches']} launches")
for k in prof["kernels"]:
    print(f"{k['ms']:8.3f} ms {k['launches']:6d}  {k['name']}")
json.dump(dict(wall_ms=ms, **prof), open(f"/tmp/r/prefill_{q or 'bf16'}_{n}.json", "w"), indent=1)
