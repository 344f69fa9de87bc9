"""Session 12: SDAR-8B batch-1 generation (1k prompt, 128 new tokens, 4 steps per block) under variants of two
module constants read at trace time (split-KV's MIN_TILES_PER_SPLIT; the quantized GEMV's weight limit), to pick
their values before changing the defaults. Scratch only: the constants are set between traces."""
import sys, time, json
import jax, jax.numpy as jnp
from dllm_jax import generate
from dllm_jax.bench.models import model_for
from dllm_jax.bench.timing import time_calls
import pallas_kernels.split_kv as skv
import dllm_jax.quantize as qz
mode = sys.argv[1]
variants = [v.split(":") for v in sys.argv[2:]]  # min_tiles:gemv_max
q = None if mode == "bf16" else mode
model, config = model_for("sdar-8b-chat", layers=None, context=2048, dtype=jnp.bfloat16, quantize=q)
ids = jax.random.randint(jax.random.key(1), (1, 1024), 0, 1000, jnp.int32)
opts = dict(max_new_tokens=128, denoising_steps=4, remasking="low_confidence_static")
out = []
for min_tiles, gemv_max in variants:
    skv.MIN_TILES_PER_SPLIT = int(min_tiles)
    if hasattr(qz, "GEMV_MAX_WEIGHT"):
        qz.GEMV_MAX_WEIGHT = int(float(gemv_max))
    jax.clear_caches()
    t0 = time.monotonic()
    toks = generate(model, ids, seed=0, **opts); jax.block_until_ready(toks)
    first = time.monotonic() - t0
    s = time_calls(lambda: generate(model, ids, seed=0, **opts), repeats=5)
    out.append(dict(mode=mode, min_tiles=min_tiles, gemv_max=gemv_max, s=s, tok_s=128 / s, first_s=first,
                    same_as_first=None))
    print(out[-1], flush=True)
    if len(out) == 1: base = toks
    else: print("tokens equal to the first variant:", bool((toks == base).all()), flush=True)
json.dump(out, open(f"/tmp/r/e2e_{mode}.json", "w"), indent=1)
for r in out:
    print(f"| {mode} | min_tiles {r['min_tiles']} | gemv_max {r['gemv_max']} | {r['tok_s']:.1f} tok/s | first {r['first_s']:.0f} s |")
