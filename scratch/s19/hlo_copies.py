"""Counts ops in the optimized CPU HLO of one SDAR output block (long_cache.block_loop), dense vs MAGE."""
import collections, re, sys, tempfile
from pathlib import Path
import jax, jax.numpy as jnp
from dllm_jax import load_model
from dllm_jax.attention.mage import MAGE
from dllm_jax.attention.policy import Dense
from dllm_jax.generate import sdar as gen
from dllm_jax.testing import tiny_sdar_config, write_hf_checkpoint
from benchmarks.sections.long_cache import block_loop
from benchmarks.sections.sdar import sdar_options
from benchmarks.sections.plan import TINY

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
config = tiny_sdar_config(num_layers=layers)
d = Path(tempfile.mkdtemp())
write_hf_checkpoint(d / "hf", config, seed=0)
model = load_model(d / "hf", dtype="float32", progress=False)
config = model.config
params = model.params()
b, n, s = 1, config.block_size, 200
capacity = gen.cache_capacity(s + 5 * n, n)
options = gen.SDAROptions(**sdar_options(TINY))
masks = jnp.full((b, n), config.mask_token_id, jnp.int32)
for name, policy in [("dense", Dense()), ("mage", MAGE(k=16, exact_layers=1))]:
    cache = model.init_cache(b, capacity)
    state = gen.sdar_model.init_policy_state(policy, config, b, capacity)
    cache = cache.replace(length=jnp.full(cache.length.shape, s, jnp.int32))
    key = jax.random.key(0)
    steps = jnp.full((b,), options.denoising_steps, jnp.int32)
    finished = gen.Finished(ids=jnp.zeros_like(masks), pending=jnp.ones((b,), bool),
                            mode=jnp.broadcast_to(policy.block_mode(steps, unmasked=jnp.zeros_like(steps), commit=True),
                                                  (b,)).astype(jnp.int32))
    fn = jax.jit(lambda p, c, st: gen.denoise_block(p, masks, c, st, key, jnp.zeros((b,), jnp.int32), jnp.ones((b,), bool),
                                                    finished, config=config, options=options, policy=policy)[:3],
                 donate_argnums=(1, 2))
    text = fn.lower(params, cache, state).compile().as_text()
    ops = collections.Counter(re.findall(r"= \S+ (\w[\w-]*)\(", text))
    print(name, {k: ops[k] for k in ("copy", "conditional", "while", "dynamic-slice", "dynamic-update-slice", "fusion",
                                     "custom-call", "sort", "concatenate", "pad", "slice")})
    if name == "mage":
        Path("/tmp/mage_hlo.txt").write_text(text)
