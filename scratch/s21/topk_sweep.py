"""Session 21: the top-k kernel's chunk, warps and stages at MAGE's 128k rows (S = 131200, k = 512), against the tile
tournament, same run; every variant checked equal. Last line: the fastest configuration (sum over batches 1, 4)."""
import functools, itertools, jax, jax.numpy as jnp, numpy as np
import pallas_kernels as pk
from dllm_jax.attention.select import top_k_positions
from dllm_jax.bench.timing import time_calls
length = 131200
total = {}
for batch in (1, 4):
    x = jax.random.uniform(jax.random.key(batch), (batch, 8, length), jnp.float32)
    x = jnp.where(jnp.arange(length) < length - 200, x, -jnp.inf)
    f = jax.jit(functools.partial(top_k_positions, k=512, method="tiles"))
    want = np.asarray(f(x))
    print(f"| B={batch} tiles | {time_calls(f, x) * 1e3:.3f} ms |", flush=True)
    for chunk, warps, stages in itertools.product((4096, 16384), (8, 16, 32), (1, 3)):
        try:
            g = jax.jit(functools.partial(pk.top_k_positions, k=512, chunk=chunk, num_warps=warps, num_stages=stages))
            ok = np.array_equal(np.asarray(g(x)), want)
            ms = time_calls(g, x) * 1e3
            print(f"| B={batch} chunk {chunk} warps {warps} stages {stages} | {ms:.3f} ms | "
                  f"{'equal' if ok else 'DIFFERENT'} |", flush=True)
            if ok:
                total[(chunk, warps, stages)] = total.get((chunk, warps, stages), 0) + ms
        except Exception as e:  # a configuration Triton refuses (registers, shared memory)
            print(f"| B={batch} chunk {chunk} warps {warps} stages {stages} | failed: {str(e).splitlines()[0][:100]} |")
            total[(chunk, warps, stages)] = float("inf")
best = min(total, key=total.get)
print("BEST", *best)
