import time, jax, jax.numpy as jnp
from dllm_jax.attention.dense import xla_attention
def bench(f, *a):
    f(*a).block_until_ready(); t = time.perf_counter(); f(*a).block_until_ready(); return time.perf_counter() - t
for (B, L, H, K, D, masked) in [(8, 1024, 8, 8, 32, False), (8, 1024, 8, 8, 32, True)]:
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    dt = jnp.bfloat16
    q = jax.random.normal(ks[0], (B, L, H, D), dt); k = jax.random.normal(ks[1], (B, L, K, D), dt); v = jax.random.normal(ks[2], (B, L, K, D), dt)
    pos = jnp.arange(L) // 4
    mask = (pos[:, None] >= pos[None, :]) if masked else None
    full = bench(jax.jit(lambda q, k, v: xla_attention(q, k, v, mask=mask)), q, k, v)
    res = [f"full {full:.3f}"]
    for C in (128, 256, 512):
        def chunked(q, k, v):
            qc = q.reshape(B, L // C, C, H, D).swapaxes(0, 1)
            mc = None if mask is None else mask.reshape(L // C, C, L)
            def one(args):
                qi, mi = args
                return xla_attention(qi, k, v, mask=mi)
            out = jax.lax.map(one, (qc, mc)) if mask is not None else jax.lax.map(lambda qi: xla_attention(qi, k, v), qc)
            return out.swapaxes(0, 1).reshape(B, L, H, D)
        res.append(f"map C={C} {bench(jax.jit(chunked), q, k, v):.3f}")
    print(B, L, masked, " | ".join(res), flush=True)
