"""The dense attention function against jax.nn.dot_product_attention (an independent XLA implementation)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.attention.dense import dense_attention, dense_implementation


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_jax_nn_attention(rng, hq, hkv, dtype):
    b, n, s, d = 2, 9, 13, 16
    q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in
               [(b, n, hq, d), (b, s, hkv, d), (b, s, hkv, d)])
    key_mask = jnp.asarray(rng.random((b, s)) > 0.3).at[:, 0].set(True)
    out = dense_attention(q, k, v, key_mask=key_mask, implementation="xla")
    with jax.default_matmul_precision("highest"):
        expected = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                                v.astype(jnp.float32), mask=key_mask[:, None, None, :])
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert out.dtype == q.dtype and out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected), atol=tol, rtol=tol)


def test_masked_keys_have_no_influence(rng):
    q, k, v = (jnp.asarray(rng.standard_normal((1, 6, 2, 8)), jnp.float32) for _ in range(3))
    key_mask = jnp.array([[True, True, False, True, False, True]])
    out = dense_attention(q, k, v, key_mask=key_mask)
    v2 = v.at[:, 2].set(100.0).at[:, 4].set(-100.0)
    k2 = k.at[:, 2].set(50.0)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(dense_attention(q, k2, v2, key_mask=key_mask)))


def test_cpu_uses_xla_and_unknown_implementation_is_rejected():
    assert dense_implementation(jnp.bfloat16, 128) == ("cudnn" if jax.default_backend() == "gpu" else "xla")
    assert dense_implementation(jnp.float32, 128) == "xla"
    x = jnp.zeros((1, 2, 1, 8))
    with pytest.raises(ValueError, match="implementation"):
        dense_attention(x, x, x, implementation="flash")
