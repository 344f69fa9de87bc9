"""Layer scan vs unrolled layers: does XLA's dynamic-slice fusion let a scan's GEMMs read stacked weights in place?"""
import sys, time
import jax, jax.numpy as jnp

L, D, F = 32, 4096, 14336
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 4
key = jax.random.key(0)
w1 = jax.random.normal(key, (L, D, F), jnp.bfloat16) * 0.01
w2 = jax.random.normal(key, (L, F, D), jnp.bfloat16) * 0.01
x = jax.random.normal(key, (rows, D), jnp.bfloat16)

def layer(h, a, b):
    return h + jax.nn.gelu(h @ a) @ b

if sys.argv[1] == "unrolled":
    ws = ([w1[i] for i in range(L)], [w2[i] for i in range(L)])
    del w1, w2
    @jax.jit
    def f(x, ws):
        for a, b in zip(*ws):
            x = layer(x, a, b)
        return x
    args = (x, ws)
else:
    @jax.jit
    def f(x, ws):
        return jax.lax.scan(lambda h, ab: (layer(h, *ab), None), x, ws)[0]
    args = (x, (w1, w2))
t = time.perf_counter(); c = f.lower(*args).compile(); ct = time.perf_counter() - t
c(*args).block_until_ready()
t = time.perf_counter()
for _ in range(20):
    out = c(*args)
out.block_until_ready()
print(f"{sys.argv[1]:10s} rows={rows:4d} flags={jax.config.jax_platforms} compile {ct:6.2f} s  warm {(time.perf_counter() - t) / 20 * 1e3:7.3f} ms")
