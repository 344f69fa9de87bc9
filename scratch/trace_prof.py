"""Trace + lower time of SDAR-8B's generate program on abstract weights (no memory): where the seconds go."""
import cProfile, pstats, sys, time
import jax, jax.numpy as jnp, numpy as np
from dllm_jax.config import shipped_config
from dllm_jax.models.layers import prepare_params
from dllm_jax.testing import random_params
from dllm_jax.generate.sdar import generate_sdar_jit, SDAROptions

config = shipped_config("sdar-8b-chat")
params = jax.eval_shape(lambda: prepare_params(random_params(config, jax.random.key(0), jnp.bfloat16), config))
opts = SDAROptions(max_new_tokens=128, denoising_steps=4, remasking="low_confidence_static", top_k=1)
ids = jax.ShapeDtypeStruct((1, 1024), jnp.int32)
rows = opts.sampling(1)
structure = opts.structure(config.vocab_size)
def go():
    t = time.perf_counter(); tr = generate_sdar_jit.trace(params, ids, None, 0, 0, rows, config=config, options=structure)
    t1 = time.perf_counter(); lo = tr.lower(); t2 = time.perf_counter()
    print(f"trace {t1 - t:.2f} s lower {t2 - t1:.2f} s", flush=True)
go()
if len(sys.argv) > 1:
    jax.clear_caches(); cProfile.run("go()", "/tmp/trace.prof")
    pstats.Stats("/tmp/trace.prof").sort_stats("cumulative").print_stats(45)
if len(sys.argv) > 2:
    import collections
    from dllm_jax.testing import jaxpr_equations
    jaxpr = generate_sdar_jit.trace(params, ids, None, 0, 0, rows, config=config, options=structure).jaxpr
    names = collections.Counter(e.params.get("name") for e in jaxpr_equations(jaxpr.jaxpr) if e.primitive.name in ("pjit", "jit"))
    print(sum(names.values()), names.most_common(40))
    prims = collections.Counter(e.primitive.name for e in jaxpr_equations(jaxpr.jaxpr))
    print(sum(prims.values()), prims.most_common(25))
