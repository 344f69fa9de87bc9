import time, sys, jax, jax.numpy as jnp, numpy as np
import dllm_jax
from dllm_jax.models import sdar
m = dllm_jax.load_model("runs/L7", dtype=sys.argv[1], progress=False)
B, P = 10, 4096
ids = jnp.asarray(np.random.default_rng(0).integers(10, 400, (B, P)), jnp.int32)
for ct in [int(x) for x in sys.argv[2:]]:
    f = jax.jit(lambda p, ids, cache: sdar.prefill(p, ids, cache, config=m.config, chunk_tokens=ct))
    cache = m.init_cache(B, P + 8) if hasattr(m, "init_cache") else None
    c = f(m.params(), ids, cache); jax.block_until_ready(c)
    t = time.perf_counter(); c = f(m.params(), ids, cache); jax.block_until_ready(c)
    print(sys.argv[1], "chunk_tokens", ct, f"{time.perf_counter()-t:.1f}s", flush=True)
