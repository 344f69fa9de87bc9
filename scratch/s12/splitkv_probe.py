"""Session 12: split-KV attention at SDAR-8B decode shapes (batch 1-4, 4 queries, 32/8 heads, D 128) against
its capacity, by num_splits and block_kv; cuDNN for reference."""
import json
import jax, jax.numpy as jnp
import pallas_kernels as pk
from dllm_jax.bench.timing import time_calls
rows = []
for b, cap, kvlen in [(1, 1280, 1100), (1, 4224, 4100), (4, 1280, 1100), (1, 33024, 32900)]:
    ks = jax.random.split(jax.random.key(cap + b), 3)
    L = 12  # layers' caches rotated so that L2 does not hold them
    q = jax.random.normal(ks[0], (b, 4, 32, 128), jnp.bfloat16)
    kk = [jax.random.normal(jax.random.fold_in(ks[1], i), (b, cap, 8, 128), jnp.bfloat16) for i in range(L)]
    vv = [jax.random.normal(jax.random.fold_in(ks[2], i), (b, cap, 8, 128), jnp.bfloat16) for i in range(L)]
    kvl = jnp.full((b,), kvlen, jnp.int32)
    default = pk.split_kv.default_num_splits(b, 8, cap, 128) if hasattr(pk, "split_kv") else None
    for bkv in (64, 128):
        for s in (1, 2, 3, 4, 6, 9, 12, 18, 33):
            if s * bkv > cap * 2: continue
            f = jax.jit(lambda q, kk, vv, kvl, s=s, bkv=bkv: [pk.split_kv_attention(q, k, v, kv_len=kvl, num_splits=s, block_kv=bkv) for k, v in zip(kk, vv)])
            try:
                us = time_calls(f, q, kk, vv, kvl, repeats=7) * 1e6 / L
            except Exception as e:
                print("error", b, cap, bkv, s, str(e)[:200]); continue
            rows.append(dict(b=b, cap=cap, kvlen=kvlen, block_kv=bkv, splits=s, us=us))
            print(rows[-1], flush=True)
    ref = pk.split_kv_attention_reference(q, kk[0], vv[0], kv_len=kvl)
    got = pk.split_kv_attention(q, kk[0], vv[0], kv_len=kvl, num_splits=9, block_kv=64)
    print("err", float(jnp.abs(got.astype(jnp.float32) - ref.astype(jnp.float32)).max()))
json.dump(rows, open("/tmp/r/splitkv.json", "w"), indent=1)
print("\n| batch | capacity | block_kv | splits | us per layer |")
for key in sorted({(r["b"], r["cap"]) for r in rows}):
    rs = sorted([r for r in rows if (r["b"], r["cap"]) == key], key=lambda r: r["us"])
    one = [r for r in rs if r["splits"] == 1 and r["block_kv"] == 128]
    for r in rs[:3] + one:
        print(f"| {r['b']} | {r['cap']} | {r['block_kv']} | {r['splits']} | {r['us']:.1f} |")
