"""Issue 40's contract: no kernel of SDAR's generate loop copies the KV cache. The whole generation is traced
with the Pallas kernels (interpret mode: the wrappers the GPU runs, without a GPU) at a capacity `generate`
allocates that is a multiple of the 128-key tile but of no kernel's larger program span; the program must
hold no pad of a cache-shaped array (a pad is a copy of the whole layer cache per call: at 128k keys it
cost dense 46 of 90 ms per block, and MAGE's scores 6.2 of 56.5 ms)."""

import functools

import jax
import numpy as np
import pytest

from dllm_jax.attention.flashblock import FlashBlock
from dllm_jax.attention.mage import MAGE
from dllm_jax.attention.policy import Dense
from dllm_jax.generate.block_loop import cache_capacity
from dllm_jax.generate.sdar import SDAROptions, generate_sdar
from dllm_jax.testing import jaxpr_equations, tiny_sdar_config

PROMPT, NEW = 300, 8  # rows of 308 positions: a 384-key cache, three 128-key tiles

POLICIES = {"dense": Dense(backend="interpret"), "mage": MAGE(k=8, exact_layers=1, backend="interpret"),
            "flashblock": FlashBlock(tau=2, backend="interpret"),
            "flashblock+mage": FlashBlock(tau=2, inner=MAGE(k=8, exact_layers=1, backend="interpret"),
                                          backend="interpret")}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_kernel_of_the_generate_loop_pads_the_cache(tiny_model, name):
    config = tiny_sdar_config()
    model = tiny_model(config)
    capacity = cache_capacity(PROMPT + NEW, config.block_size)
    assert capacity == 384
    layer_cache = (1, capacity, config.num_kv_heads, config.head_dim)
    run = functools.partial(generate_sdar, config=config, options=SDAROptions(max_new_tokens=NEW, top_k=1),
                            policy=POLICIES[name])
    jaxpr = jax.make_jaxpr(run)(model.params(), np.arange(PROMPT, dtype=np.int32)[None] % 170, None, 0)
    equations = list(jaxpr_equations(jaxpr.jaxpr))
    calls = [e for e in equations if e.primitive.name == "pallas_call"]
    assert any(tuple(x.aval.shape) == layer_cache for e in calls for x in e.invars)  # the kernels take the cache
    pads = [e for e in equations if e.primitive.name == "pad" and tuple(e.invars[0].aval.shape) == layer_cache]
    assert not pads, [str(e)[:200] for e in pads]
