import time, jax, jax.numpy as jnp
from dllm_jax.attention.dense import xla_attention
B, L, H, K, D = 10, 4096, 8, 4, 64
ks = jax.random.split(jax.random.PRNGKey(0), 3)
for dt in (jnp.bfloat16, jnp.float32):
    q = jax.random.normal(ks[0], (B, L, H, D), dt); k = jax.random.normal(ks[1], (B, L, K, D), dt); v = jax.random.normal(ks[2], (B, L, K, D), dt)
    pos = jnp.arange(L) // 4
    mask = pos[:, None] >= pos[None, :]
    f = jax.jit(lambda q, k, v: xla_attention(q, k, v, mask=mask))
    f(q, k, v).block_until_ready()
    t = time.perf_counter(); f(q, k, v).block_until_ready(); dt_full = time.perf_counter() - t
    C = 512
    def chunked(q, k, v):
        outs = []
        for i in range(L // C):
            e = (i + 1) * C
            outs.append(xla_attention(q[:, i*C:e], k[:, :e], v[:, :e], mask=mask[i*C:e, :e]))
        return jnp.concatenate(outs, 1)
    g = jax.jit(chunked)
    g(q, k, v).block_until_ready()
    t = time.perf_counter(); o = g(q, k, v).block_until_ready(); dt_ch = time.perf_counter() - t
    print(dt.__name__, f"full {dt_full:.2f}s chunked {dt_ch:.2f}s  (x8 layers: {8*dt_full:.0f}s vs {8*dt_ch:.0f}s)", float(jnp.abs(o.astype(jnp.float32) - f(q,k,v).astype(jnp.float32)).max()))
