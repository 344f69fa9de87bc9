"""Session 21: the top k alone at MAGE's 128k rows: the Pallas kernel against the tile tournament, same run."""
import functools, jax, jax.numpy as jnp, numpy as np
from dllm_jax.attention.select import top_k_positions
from dllm_jax.bench.timing import time_calls
for batch in (1, 4):
    for length in (131200, 131072):
        x = jax.random.uniform(jax.random.key(batch), (batch, 8, length), jnp.float32)
        x = jnp.where(jnp.arange(length) < length - 200, x, -jnp.inf)
        res = {}
        for m in ("tiles", "kernel"):
            f = jax.jit(functools.partial(top_k_positions, k=512, method=m))
            res[m] = (np.asarray(f(x)), time_calls(f, x) * 1e3)
        print(f"| top-k B={batch} S={length} | tiles {res['tiles'][1]:.3f} ms | kernel {res['kernel'][1]:.3f} ms | "
              f"equal {np.array_equal(res['tiles'][0], res['kernel'][0])} |", flush=True)
