"""Session 21: the top-k kernel's GPU time per layer (34 rows blocks in one jitted lax.map: dispatch amortised) at
S = 131200, k = 512, against the tile tournament; and its parts: the bisection alone over 16384 int32 per row."""
import functools, itertools, jax, jax.numpy as jnp, numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
import pallas_kernels as pk
from pallas_kernels import top_k as t
from dllm_jax.attention.select import top_k_positions
from dllm_jax.bench.timing import time_calls
length, layers = 131200, 34

def per_layer(f, xs):
    g = jax.jit(lambda xs: jax.lax.map(f, xs))
    out = g(xs)
    return np.asarray(out), time_calls(g, xs) / layers * 1e6

def bisect_only(m, warps):
    def kern(m_ref, o_ref):
        v = m_ref[...]
        o_ref[...] = jnp.broadcast_to(t._kth_largest(v, jnp.ones(v.shape, jnp.bool_), 1024), (2,))
    return pl.pallas_call(kern, grid=(m.shape[0],), in_specs=[pl.BlockSpec((None, m.shape[1]), lambda i: (i, 0))],
                          out_specs=pl.BlockSpec((None, 2), lambda i: (i, 0)),
                          out_shape=jax.ShapeDtypeStruct((m.shape[0], 2), jnp.int32),
                          compiler_params=plt.CompilerParams(num_warps=warps, num_stages=1))(m)

for batch in (1, 4):
    xs = jax.random.uniform(jax.random.key(batch), (layers, batch, 8, length), jnp.float32)
    xs = jnp.where(jnp.arange(length) < length - 200, xs, -jnp.inf)
    want, us = per_layer(functools.partial(top_k_positions, k=512, method="tiles"), xs)
    print(f"| B={batch} tiles | {us:.1f} us/layer |", flush=True)
    for chunk, warps in itertools.product((4096, 16384), (4, 8, 16)):
        got, us = per_layer(functools.partial(pk.top_k_positions, k=512, chunk=chunk, num_warps=warps, num_stages=1), xs)
        print(f"| B={batch} kernel chunk {chunk} warps {warps} | {us:.1f} us/layer | {np.array_equal(got, want)} |",
              flush=True)
    ms = jax.random.randint(jax.random.key(7), (layers, batch * 8, 16384), -2**31, 2**31 - 1, jnp.int32)
    for warps in (4, 8, 16):
        _, us = per_layer(functools.partial(bisect_only, warps=warps), ms)
        print(f"| B={batch} bisection of 16384 alone, warps {warps} | {us:.1f} us/layer |", flush=True)
