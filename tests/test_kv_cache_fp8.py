"""The float8 KV cache (`kv_cache_dtype="fp8"`): rows quantized as they enter the cache, read by the split-KV
kernel (dequantized in registers) or dequantized for every other reader; generate, the slot engine and the
command line; refused where it cannot run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dllm_jax
from dllm_jax.attention import kv_rows
from dllm_jax.attention.policy import Dense
from dllm_jax.generate.llada2 import LLaDA2Options
from dllm_jax.generate.requests import cache_dtype_of
from dllm_jax.generate.sdar import SDAROptions
from dllm_jax.models import block_diffusion, sdar
from dllm_jax.serve.engine import Engine
from dllm_jax.testing import tiny_llada2_config, tiny_sdar_config
from test_llada_numerics import relative_error

E4M3_STEP = 2.0 ** -3  # e4m3 keeps 3 mantissa bits: a value rounds to within half a step of 1/8 of its binade


def test_quantized_rows_round_trip_within_e4m3_rounding(rng):
    x = jnp.asarray(rng.standard_normal((2, 7, 3, 32)) * rng.uniform(0.01, 100, (2, 7, 3, 1)), jnp.float32)
    x = x.at[1, 2, 0].set(0.0)  # an all-zero row: scale 1, zeros back
    data, scale = kv_rows.quantize_rows(x)
    assert data.dtype == jnp.float8_e4m3fn and scale.shape == (2, 7, 3)
    back = np.asarray(kv_rows.dense_rows(kv_rows.QuantizedRows(data=data, scale=scale), jnp.float32))
    amax = np.max(np.abs(np.asarray(x)), axis=-1, keepdims=True)
    assert np.all(np.abs(back - np.asarray(x)) <= E4M3_STEP / 2 * np.maximum(np.abs(np.asarray(x)), amax / 64))
    np.testing.assert_array_equal(back[1, 2, 0], 0.0)
    assert float(scale[1, 2, 0]) == 1.0


def test_writes_quantize_each_position_and_leave_the_rest(rng):
    """write_rows and write_span put each new position's quantized form at its place in a quantized layer."""
    layer = kv_rows.zeros((2, 10, 2, 16), kv_rows.FP8)
    new = jnp.asarray(rng.standard_normal((2, 3, 2, 16)), jnp.float32)
    rows = kv_rows.write_rows(layer, new, jnp.asarray([0, 5]))
    span = kv_rows.write_span(layer, new, 4)
    data, scale = kv_rows.quantize_rows(new)
    for got, starts in ((rows, (0, 5)), (span, (4, 4))):
        assert isinstance(got, kv_rows.QuantizedRows)
        for b, s in enumerate(starts):
            np.testing.assert_array_equal(np.asarray(got.data[b, s:s + 3], np.float32), np.asarray(data[b], np.float32))
            np.testing.assert_array_equal(np.asarray(got.scale[b, s:s + 3]), np.asarray(scale[b]))
            rest = np.delete(np.asarray(got.data[b], np.float32), range(s, s + 3), axis=0)
            assert not rest.any()


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(tiny_sdar_config())


def test_cached_forward_reads_the_float8_cache_close_to_the_exact_one(model, rng):
    """prefill + a commit-and-step forward on a float8 cache: logits within e4m3's rounding of the float32 cache's,
    and the same through the split-KV kernel (interpret mode) as through the dequantized rows (XLA)."""
    config, params, n = model.config, model.params(), model.config.block_size
    ids = jnp.asarray(rng.integers(0, 170, (2, 6 * n)))

    def forward(dtype, policy):
        cache = sdar.prefill(block_diffusion.unrolled(params, config), ids[:, :4 * n],
                             block_diffusion.init_cache(config, 2, 8 * n, dtype), config=config)
        states = block_diffusion.init_policy_state(policy, config, 2, 8 * n)
        zeros = jnp.zeros((2,), jnp.int32)
        return sdar.commit_and_step(params, ids[:, 4 * n:5 * n], jnp.asarray([True, False]), ids[:, 5 * n:], cache,
                                    states, zeros, zeros, config=config, policy=policy)

    exact = forward(jnp.float32, Dense())[0]
    xla, cache, _ = forward(kv_rows.FP8, Dense())
    kernel = forward(kv_rows.FP8, Dense(backend="interpret"))[0]
    assert all(isinstance(layer, kv_rows.QuantizedRows) for layer in cache.k + cache.v)
    assert relative_error(xla, np.asarray(exact, np.float64)) <= 0.05
    assert relative_error(kernel, np.asarray(xla, np.float64)) <= 1e-4  # two orders of summation


def test_generate_and_the_engine_decode_alike_on_a_float8_cache(model, rng):
    """generate with the float8 cache through the split-KV kernel equals it through the dequantized rows, and the
    slot engine (a prompt prefilled a chunk per step among them) gives each request what generate gives it alone."""
    prompts = [rng.integers(0, 170, length).astype(np.int32) for length in (5, 23, 40)]
    options = dict(max_new_tokens=12, top_k=1, kv_cache_dtype="fp8")
    alone = [np.asarray(dllm_jax.generate(model, p[None], **options))[0, len(p):] for p in prompts]
    kernel = np.asarray(dllm_jax.generate(model, prompts[1][None], method=Dense(backend="interpret"), **options))
    np.testing.assert_array_equal(kernel[0, len(prompts[1]):], alone[1])
    engine = Engine(model, slots=2, max_context=96, prefill_chunk=16, top_k=1, kv_cache_dtype="fp8")
    assert isinstance(engine.state.carry.cache.k[0], kv_rows.QuantizedRows)
    ids = [engine.submit(p, 12, 0) for p in prompts]
    done = {}
    while len(done) < len(ids):
        done |= {c.request_id: c for c in engine.step()}
    for request_id, prompt, want in zip(ids, prompts, alone):
        np.testing.assert_array_equal(np.asarray(done[request_id].tokens)[len(prompt):len(prompt) + 12], want[:12])


def test_llada2_generates_on_a_float8_cache(tiny_model, rng):
    llada2 = tiny_model(tiny_llada2_config())
    ids = rng.integers(0, 150, (1, 40)).astype(np.int32)
    options = dict(gen_length=32, block_length=32, steps=8, kv_cache_dtype="fp8")
    xla = np.asarray(dllm_jax.generate(llada2, ids, **options))
    kernel = np.asarray(dllm_jax.generate(llada2, ids, method=Dense(backend="interpret"), **options))
    np.testing.assert_array_equal(kernel, xla)
    assert xla.shape == (1, 72)


def test_float8_cache_is_refused_where_it_cannot_run(model):
    with pytest.raises(ValueError, match="kv_cache_dtype='fp16' is not one of"):
        SDAROptions(kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLaDA2Options(kv_cache_dtype=jnp.float8_e4m3fn)
    ids = np.zeros((1, 8), np.int32)
    with pytest.raises(ValueError, match="runs with dense attention; MAGE"):
        dllm_jax.generate(model, ids, max_new_tokens=4, kv_cache_dtype="fp8", method="mage")
    with pytest.raises(ValueError, match="runs with dense attention; FlashBlock"):
        Engine(model, slots=2, max_context=32, method="flashblock", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="runs on one device"):
        cache_dtype_of("fp8", Dense(), jnp.float32, mesh=jax.make_mesh((1,), ("tp",)))
    with pytest.raises(ValueError, match="kv_cache_dtype"):  # LLaDA's Fast-dLLM caches have no float8 form
        dllm_jax.generate(dllm_jax.LLaDA(dllm_jax.testing.tiny_llada_config(), rngs=__import__("flax").nnx.Rngs(0)),
                          ids, gen_length=8, steps=8, kv_cache_dtype="fp8")


@pytest.mark.gpu
def test_gpu_generation_reads_the_float8_cache_in_the_split_kv_kernel(model, rng):
    """On a GPU the Triton split-KV kernel reads the float8 rows: the tokens of the dequantized rows (XLA)."""
    ids = rng.integers(0, 170, (2, 37)).astype(np.int32)
    options = dict(max_new_tokens=16, top_k=1, kv_cache_dtype="fp8")
    kernel = np.asarray(dllm_jax.generate(model, ids, method=Dense(backend="triton"), **options))
    xla = np.asarray(dllm_jax.generate(model, ids, method=Dense(backend="xla"), **options))
    np.testing.assert_array_equal(kernel, xla)
