"""The memory-light training attention (dllm_jax.train.attention): equal to the materialised masks it
replaces, forward and gradients, on shapes that leave partial chunks and partial blocks; no [L, L] array
in its program; the losses through it equal the reference losses."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.attention.dense import dense_attention, xla_attention
from dllm_jax.testing import jaxpr_equations, tiny_llada_config, tiny_sdar_config
from dllm_jax.train import TrainConfig, init_params, two_copy_mask
from dllm_jax.train.attention import chunk_size, padded_attention, two_copy_attention
from dllm_jax.train.loop import loss_fn


def qkv(rng, b, n, hq, hkv, d, dtype=jnp.float32):
    return [jnp.asarray(rng.standard_normal((b, n, h, d)), dtype) for h in (hq, hkv, hkv)]


def value_and_grads(attention, q, k, v, weights):
    """(output, gradients of a random projection of it) of attention(q, k, v), jitted."""
    def both(q, k, v):
        grads = jax.grad(lambda *a: (attention(*a).astype(jnp.float32) * weights).sum(), argnums=(0, 1, 2))(q, k, v)
        return attention(q, k, v), grads

    return jax.jit(both)(q, k, v)


def assert_same(got, want, tol):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol)


# (length, block size, chunk): a partial last block and chunk, a chunk above the length, several
# chunks of two blocks, a chunk below one block (rounded up to it)
TWO_COPY_CASES = [(10, 4, 4), (13, 4, 512), (18, 3, 6), (12, 4, 1)]


@pytest.mark.parametrize("length, block, chunk", TWO_COPY_CASES)
def test_two_copy_attention_equals_the_materialised_mask(rng, length, block, chunk):
    q, k, v = qkv(rng, 2, 2 * length, 4, 2, 8)
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    got = value_and_grads(lambda *a: two_copy_attention(*a, block_size=block, chunk=chunk), q, k, v, weights)
    want = value_and_grads(lambda *a: xla_attention(*a, mask=two_copy_mask(length, block)), q, k, v, weights)
    assert_same(got, want, 2e-5)


@pytest.mark.parametrize("length, chunk", [(10, 4), (13, 512), (16, 16), (7, 1)])
def test_padded_attention_equals_the_key_mask(rng, length, chunk):
    q, k, v = qkv(rng, 3, length, 6, 2, 8)
    lengths = jnp.asarray([length, length - 3, 1], jnp.int32)
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    key_mask = jnp.arange(length)[None] < lengths[:, None]
    got = value_and_grads(lambda *a: padded_attention(*a, lengths, chunk=chunk), q, k, v, weights)
    want = value_and_grads(lambda *a: xla_attention(*a, key_mask=key_mask), q, k, v, weights)
    assert_same(got, want, 2e-5)


def test_bfloat16_keeps_the_reference_numerics(rng):
    """fp32 logits and softmax, probabilities in the values' dtype: the reference's rounding, not a new one."""
    q, k, v = qkv(rng, 2, 24, 4, 2, 16, jnp.bfloat16)
    got = two_copy_attention(q, k, v, block_size=4, chunk=8)
    assert got.dtype == jnp.bfloat16
    assert_same(got, xla_attention(q, k, v, mask=two_copy_mask(12, 4)), 2e-2)


def squares(jaxpr, size: int) -> list:
    """Shapes of the values in the program (nested programs included) with two axes of at least `size`."""
    return [v.aval.shape for e in jaxpr_equations(jaxpr.jaxpr) for v in e.outvars
            if sum(dim >= size for dim in getattr(v.aval, "shape", ())) >= 2]


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_the_training_step_builds_no_length_by_length_array(rng, family):
    """Loss and gradients at L = 320 (above the tiny models' widths and vocabularies) with 32-query chunks:
    nothing in the program is [.., >= L, .., >= L] (SDAR's materialised path has [2L, 2L] masks, which the
    check does find; LLaDA's has none on a CPU either, where XLA attention runs in 128-row query chunks)."""
    length = 320
    config = tiny_llada_config if family == "llada" else tiny_sdar_config
    model = config(max_position_embeddings=length)
    params = init_params(model, jax.random.PRNGKey(0))
    tokens = jnp.asarray(rng.integers(3, 60, (2, length)), jnp.int32)
    args = (params, tokens, jnp.ones((2, length), bool), jnp.full(2, length, jnp.int32), jax.random.PRNGKey(1))
    for chunk, expect_square in ((32, False), (None, True)) if family == "sdar" else ((32, False),):
        loss = loss_fn(TrainConfig(model=model, steps=2, batch_size=2, seq_length=length, attention_chunk=chunk))
        found = squares(jax.make_jaxpr(jax.value_and_grad(loss, has_aux=True))(*args), length)
        assert bool(found) == expect_square, found


def reference_loss(config):
    """The same loss through the materialised masks (attention_chunk=None)."""
    return loss_fn(dataclasses.replace(config, attention_chunk=None))


@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_losses_and_gradients_equal_the_materialised_ones(rng, family):
    """fp32, rows of different real lengths, a length that is no multiple of the chunk."""
    length = 22 if family == "llada" else 20
    model = tiny_llada_config() if family == "llada" else tiny_sdar_config()
    config = TrainConfig(model=model, steps=2, batch_size=3, seq_length=length, attention_chunk=8,
                         compute_dtype="float32")
    params = init_params(model, jax.random.PRNGKey(int(rng.integers(1 << 30))))
    params = jax.tree.map(lambda p: p * 10 if p.ndim > 1 else p, params)  # attention far from uniform
    tokens = jnp.asarray(rng.integers(3, 60, (3, length)), jnp.int32)
    lengths = jnp.asarray([length, length - 4, length - 8], jnp.int32)
    loss_mask = jnp.arange(length)[None] < lengths[:, None]
    args = (params, tokens, loss_mask, lengths, jax.random.PRNGKey(3))
    (loss, metrics), grads = jax.jit(jax.value_and_grad(loss_fn(config), has_aux=True))(*args)
    (want, want_metrics), want_grads = jax.jit(jax.value_and_grad(reference_loss(config), has_aux=True))(*args)
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-5)
    assert int(metrics.masked) == int(want_metrics.masked) > 0
    # fp32 rounding of two summation orders, amplified by the sharp attention: relative to each tensor's scale
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max())),
                 grads, want_grads)


def test_chunk_sizes_and_bad_chunks():
    assert chunk_size(100, 512) == 100 and chunk_size(100, 32) == 32
    assert chunk_size(10, 512, 4) == 12 and chunk_size(100, 30, 4) == 28 and chunk_size(100, 2, 4) == 4
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        chunk_size(10, 0)
    with pytest.raises(ValueError, match="attention_chunk"):
        TrainConfig(model=tiny_sdar_config(), steps=2, batch_size=1, seq_length=8, attention_chunk=0)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llada", "sdar"])
def test_gpu_bfloat16_paths_equal_the_materialised_masks(rng, family):
    """On a GPU in bf16 the chunks run cuDNN (LLaDA: one call with key lengths, no mask): the same
    attention and gradients as the materialised masks through cuDNN, at 1k tokens, head_dim 64."""
    length = 1000
    if family == "llada":
        q, k, v = qkv(rng, 2, length, 4, 2, 64, jnp.bfloat16)
        lengths = jnp.asarray([length, 777], jnp.int32)
        got_fn = lambda *a: padded_attention(*a, lengths, chunk=256)  # noqa: E731
        want_fn = lambda *a: dense_attention(*a, key_mask=jnp.arange(length)[None] < lengths[:, None])  # noqa: E731
    else:
        q, k, v = qkv(rng, 2, 2 * length, 4, 2, 64, jnp.bfloat16)
        got_fn = lambda *a: two_copy_attention(*a, block_size=4, chunk=256)  # noqa: E731
        want_fn = lambda *a: dense_attention(*a, mask=two_copy_mask(length, 4))  # noqa: E731
    weights = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    got, want = value_and_grads(got_fn, q, k, v, weights), value_and_grads(want_fn, q, k, v, weights)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= 2e-2 * np.abs(b).max(), (np.abs(a - b).max(), np.abs(b).max())
