"""Session 18: kv_scores tile configuration at SDAR-8B shapes, 128k cache, batches 1 and 4 (time per call, each
checked against the default configuration's output)."""
import itertools, sys, time
import jax, jax.numpy as jnp, numpy as np
from pallas_kernels.kv_scores import kv_scores
from dllm_jax.bench.timing import time_calls
from dllm_jax.generate.sdar import cache_capacity

LENGTH = 131072
budget = float(sys.argv[1]) if len(sys.argv) > 1 else 200
t0 = time.time()
rows = []
for batch in (1, 4):
    cap = cache_capacity(LENGTH + 4, 4)
    ks = jax.random.split(jax.random.key(batch), 3)
    q = jax.random.normal(ks[0], (batch, 4, 32, 128), jnp.bfloat16)
    k = jax.random.normal(ks[1], (batch, cap, 8, 128), jnp.bfloat16)
    lse = 10 + jax.random.uniform(ks[2], (batch, 32, 4), jnp.float32)
    kv_len = jnp.full((batch,), LENGTH, jnp.int32)
    nbytes = batch * LENGTH * 8 * 128 * 2
    want = np.asarray(kv_scores(q, k, lse, kv_len=kv_len))

    def go(**cfg):
        fn = jax.jit(lambda q, k, lse, kv_len: kv_scores(q, k, lse, kv_len=kv_len, **cfg))
        try:
            got = np.asarray(fn(q, k, lse, kv_len))
        except Exception as e:  # noqa
            print("fail", batch, cfg, str(e)[:200]); return None
        ok = bool(np.allclose(got, want, rtol=1e-5, atol=1e-12))
        ms = time_calls(fn, q, k, lse, kv_len) * 1e3
        row = dict(batch=batch, **cfg, ms=ms, tbs=nbytes / ms / 1e9, ok=ok)
        rows.append(row); print(row, flush=True)
        return row

    go()  # the default
    grid = list(itertools.product((64, 128, 256), (1, 2, 4, 8, 16), (2, 4, 8)))
    for bkv, tiles, warps in grid:
        if time.time() - t0 > budget * (0.35 if batch == 1 else 0.8):
            break
        go(block_kv=bkv, tiles_per_program=tiles, num_warps=warps, num_stages=2)
    best = sorted((r for r in rows if r["batch"] == batch and r["ok"] and "block_kv" in r), key=lambda r: r["ms"])[:3]
    for r in best:
        for st in (1, 3, 4):
            if time.time() - t0 > budget * (0.45 if batch == 1 else 0.95):
                break
            go(block_kv=r["block_kv"], tiles_per_program=r["tiles_per_program"], num_warps=r["num_warps"], num_stages=st)
print("| batch | block_kv | tiles | warps | stages | ms | TB/s | equal |")
for batch in (1, 4):
    default = [r for r in rows if r["batch"] == batch and "block_kv" not in r]
    for r in default + sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["ms"])[:8]:
        print(f"| {batch} | {r.get('block_kv', 'default')} | {r.get('tiles_per_program', '')} | {r.get('num_warps', '')} | "
              f"{r.get('num_stages', '')} | {r['ms']:.4f} | {r['tbs']:.2f} | {r['ok']} |")
