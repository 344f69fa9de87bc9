"""The dense attention function against jax.nn.dot_product_attention (an independent XLA implementation);
the backend vocabulary's dense resolution, and that "reference" reaches the dense steps of the methods."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.attention import backends, kernels
from dllm_jax.attention.dense import dense_attention, query_chunked_attention, xla_attention
from dllm_jax.testing import jaxpr_equations
from dllm_jax.attention.policy import Mode
from dllm_jax.attention.sparsed import SparseD


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_matches_jax_nn_attention(rng, hq, hkv, dtype):
    b, n, s, d = 2, 9, 13, 16
    q, k, v = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in
               [(b, n, hq, d), (b, s, hkv, d), (b, s, hkv, d)])
    key_mask = jnp.asarray(rng.random((b, s)) > 0.3).at[:, 0].set(True)
    out = dense_attention(q, k, v, key_mask=key_mask, backend="xla")
    with jax.default_matmul_precision("highest"):
        expected = jax.nn.dot_product_attention(q.astype(jnp.float32), k.astype(jnp.float32),
                                                v.astype(jnp.float32), mask=key_mask[:, None, None, :])
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert out.dtype == q.dtype and out.shape == q.shape
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(expected), atol=tol, rtol=tol)


@pytest.mark.parametrize("n,chunk", [(37, 8), (40, 8), (9, 16)])
@pytest.mark.parametrize("masks", ["block", "batch_block", "keys_and_fill"])
@pytest.mark.parametrize("key_buckets", [1, 3])
def test_query_chunks_compute_every_row_as_one_pass(rng, n, chunk, masks, key_buckets):
    # chunks of unequal division (37 rows in 5 chunks of 8 with 3 padded rows), exact division, and one chunk;
    # with key buckets, each chunk attends to the shortest of 3 key prefixes that holds every key it may see
    b, s, hq, hkv, d = 2, n + 5, 4, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for shape in
               [(b, n, hq, d), (b, s, hkv, d), (b, s, hkv, d)])
    block = (np.arange(n)[:, None] + 5) // 4 >= np.arange(s)[None, :] // 4
    batch_block = block[None] & (rng.random((b, n, s)) > 0.2)
    batch_block[0, 2] = False  # a row that sees no key keeps its uniform softmax over all of them
    given = {"block": dict(mask=jnp.asarray(block)),
             "batch_block": dict(mask=jnp.asarray(batch_block)),
             "keys_and_fill": dict(key_mask=jnp.asarray(rng.random((b, s)) > 0.3), kv_len=jnp.array([s - 3, s]))}[masks]
    got = query_chunked_attention(q, k, v, chunk=chunk, scale=0.3, key_buckets=key_buckets, **given)
    want = xla_attention(q, k, v, scale=0.3, **given)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)


def test_key_buckets_take_the_shortest_key_prefix_a_chunk_needs(rng):
    """Under a causal mask the first of 4 chunks needs the first quarter of the keys: its rows equal one pass,
    and the program holds one branch per prefix (4 key lengths), each a slice of the keys."""
    n = s = 64
    q, k, v = (jnp.asarray(rng.standard_normal((1, n, 2, 8)), jnp.float32) for _ in range(3))
    causal = jnp.asarray(np.tril(np.ones((n, s), bool)))
    run = lambda q, k, v: query_chunked_attention(q, k, v, mask=causal, chunk=16, key_buckets=4)  # noqa: E731
    np.testing.assert_allclose(np.asarray(run(q, k, v)), np.asarray(xla_attention(q, k, v, mask=causal)),
                               atol=1e-6, rtol=1e-6)
    jaxpr = jax.make_jaxpr(run)(q, k, v)
    switches = [e for e in jaxpr_equations(jaxpr.jaxpr) if e.primitive.name == "cond"]
    assert len(switches) == 1 and len(switches[0].params["branches"]) == 4
    key_lengths = {e.outvars[0].aval.shape[1]
                   for branch in switches[0].params["branches"] for e in branch.jaxpr.eqns
                   if e.primitive.name == "slice" and e.invars[0].aval.shape[1] == s}
    assert key_lengths == {16, 32, 48}  # the fourth prefix is every key: no slice


def test_xla_backend_on_a_cpu_runs_query_chunks_and_reference_one_pass(rng):
    q, k, v = (jnp.asarray(rng.standard_normal((1, 300, 2, 8)), jnp.float32) for _ in range(3))
    loops = {}
    for backend in ("xla", "reference"):
        jaxpr = jax.make_jaxpr(lambda q, k, v: dense_attention(q, k, v, backend=backend))(q, k, v)
        loops[backend] = sum(eqn.primitive.name in ("scan", "while") for eqn in jaxpr_equations(jaxpr))
    assert jax.default_backend() == "cpu" and loops == {"xla": 1, "reference": 0}
    np.testing.assert_allclose(np.asarray(dense_attention(q, k, v, backend="xla")),
                               np.asarray(dense_attention(q, k, v, backend="reference")), atol=1e-6, rtol=1e-6)


def test_masked_keys_have_no_influence(rng):
    q, k, v = (jnp.asarray(rng.standard_normal((1, 6, 2, 8)), jnp.float32) for _ in range(3))
    key_mask = jnp.array([[True, True, False, True, False, True]])
    out = dense_attention(q, k, v, key_mask=key_mask)
    v2 = v.at[:, 2].set(100.0).at[:, 4].set(-100.0)
    k2 = k.at[:, 2].set(50.0)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(dense_attention(q, k2, v2, key_mask=key_mask)))


@pytest.mark.parametrize("backend", ["reference", "xla", "interpret"])
def test_a_fill_length_per_query_hides_each_querys_own_keys(rng, backend):
    """kernels.attention with kv_len [B, L] (segments seeing different cache prefixes): the split-KV kernel takes it
    as it is ("interpret"), the jnp attention as the block mask it is; each query equals its own call."""
    q = jnp.asarray(rng.standard_normal((2, 6, 4, 32)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((2, 40, 2, 32)), jnp.float32) for _ in range(2))
    lengths = jnp.asarray([[5, 5, 5, 9, 9, 9], [40, 1, 17, 30, 30, 2]], jnp.int32)
    out = kernels.attention(q, k, v, backend, kv_len=lengths)
    for i in range(6):
        alone = kernels.attention(q[:, i:i + 1], k, v, "reference", kv_len=lengths[:, i])
        np.testing.assert_allclose(np.asarray(out[:, i:i + 1]), np.asarray(alone), rtol=1e-5, atol=1e-5)


def test_cpu_uses_xla_and_unknown_backend_is_rejected():
    assert backends.dense_default(jnp.bfloat16, 128) == ("cudnn" if jax.default_backend() == "gpu" else "xla")
    assert backends.dense_default(jnp.float32, 128) == "xla"
    x = jnp.zeros((1, 2, 1, 8))
    with pytest.raises(ValueError, match="backend"):
        dense_attention(x, x, x, backend="flash")
    with pytest.raises(ValueError, match="not one of"):  # Pallas kernels go through kernels.attention / Dense
        dense_attention(x, x, x, backend="triton")


def spec(n, dtype=jnp.bfloat16, heads=4, kv_heads=2, d=128):
    return jax.ShapeDtypeStruct((1, n, heads, d), dtype), jax.ShapeDtypeStruct((1, 4096, kv_heads, d), dtype)


def test_dense_resolution_table_for_a_gpu():
    """`backends.dense` is a pure function of the backend, the call and the platform: resolved for a
    GPU here on any machine. "reference" is the jnp attention whatever the device."""
    q, k = spec(256)
    block, _ = spec(4)
    kv_len = jnp.int32(100)
    table = {
        "auto": [("dense", "cudnn"), ("split_kv", "triton"), ("dense", "cudnn")],
        "reference": [("dense", "xla")] * 3,
        "xla": [("dense", "xla")] * 3,
        "cudnn": [("dense", "cudnn")] * 3,
        "triton": [("flash", "triton"), ("split_kv", "triton"), ("dense", "cudnn")],
        "mosaic": [("flash", "mosaic"), ("flash", "mosaic"), ("dense", "cudnn")],
        "interpret": [("flash", "interpret"), ("split_kv", "interpret"), ("dense", "cudnn")],
    }
    for backend, (full, cache_block, masked) in table.items():
        assert backends.dense(backend, q, k, on="gpu") == full, backend
        assert backends.dense(backend, block, k, kv_len=kv_len, on="gpu") == cache_block, backend
        assert backends.dense(backend, block, k, kv_len=kv_len, mask=jnp.ones((4, 4096), bool), on="gpu") == masked
    # fp32 has no cuDNN path; a CPU resolves "auto" to the jnp attention
    assert backends.dense("auto", *spec(256, jnp.float32), on="gpu") == ("dense", "xla")
    assert backends.dense("auto", block, k, kv_len=kv_len, on="cpu") == ("dense", "xla")
    # a query block too long for the split-KV tile takes the flash kernel under "triton"
    assert backends.dense("triton", q, k, kv_len=kv_len, on="gpu") == ("flash", "triton")


def test_kernel_resolution_for_a_gpu():
    q, _ = spec(256)
    assert backends.kernel("auto", q, on="cpu") == "reference"
    assert backends.kernel("auto", q, on="gpu") == "triton"  # a kernel with no Mosaic version
    assert backends.kernel("mosaic", q, on="gpu") == "triton"
    assert backends.kernel("reference", q, on="gpu") == "reference"
    assert backends.kernel("interpret", q, mosaic_kernel=True, on="gpu") == "interpret"
    for bad in ("cudnn", "xla", "pallas", "gpu"):
        with pytest.raises(ValueError, match="not one of"):
            backends.kernel(bad, q, on="gpu")


@pytest.mark.parametrize("dense,meant", [("xla", "'reference'"), ("cudnn", "'auto'")])
def test_dense_attentions_names_are_refused_for_a_method_naming_what_it_means_there(dense, meant):
    with pytest.raises(ValueError, match=f"backend={dense!r} is not one of .*use {meant}"):
        SparseD(backend=dense)


def test_sparsed_reference_dense_steps_run_the_jnp_attention(rng):
    """The bug this guards: `kernels.dense` dropped its backend, so SparseD(backend="reference") ran
    cuDNN for its dense steps on a GPU. Now a method's dense steps run its backend's code: under
    "reference" the whole SparseD step (every mode's branch) traces no Pallas call and no custom call
    (cuDNN's is one); the dense step alone traces the flash kernel under "interpret" and none under
    "reference"; both give the jnp attention's output."""
    q, k, v = (jnp.asarray(rng.standard_normal((1, 32, 2, 16)), jnp.float32) for _ in range(3))

    def step(backend, mode):
        method = SparseD(block_size=16, backend=backend).bind(total_steps=8, prompt_length=16)
        state = method.init_state(batch=1, num_heads=2, num_kv_heads=2, q_len=32, kv_len=32, head_dim=16)
        return lambda q, k, v: method.attend(q, k, v, state, mode)[0]

    text = str(jax.make_jaxpr(step("reference", jnp.int32(Mode.DENSE)))(q, k, v))
    assert "pallas_call" not in text and "custom_call" not in text and "cudnn" not in text
    for backend, pallas in (("reference", False), ("interpret", True)):
        dense_step = str(jax.make_jaxpr(lambda q, k, v: kernels.dense(q, k, v, backend))(q, k, v))
        assert ("pallas_call" in dense_step) == pallas and "custom_call" not in dense_step, backend
        np.testing.assert_allclose(step(backend, Mode.DENSE)(q, k, v), dense_attention(q, k, v, backend="reference"),
                                   atol=1e-5)
    assert backends.dense("reference", q, k, on="gpu") == ("dense", "xla")  # the same on a GPU (table above)


@pytest.mark.gpu
def test_sparsed_reference_dense_steps_lower_without_cudnn_on_gpu(rng):
    """On the GPU: the DENSE step of SparseD(backend="reference") lowers to no cuDNN call; "auto"'s does."""
    q, k, v = (jnp.asarray(rng.standard_normal((1, 256, 4, 128)), jnp.bfloat16) for _ in range(3))

    def hlo(backend):
        method = SparseD(block_size=128, backend=backend).bind(total_steps=8, prompt_length=128)
        state = method.init_state(batch=1, num_heads=4, num_kv_heads=4, q_len=256, kv_len=256, head_dim=128)
        return jax.jit(lambda q, k, v: method.attend(q, k, v, state, Mode.DENSE)[0]).lower(q, k, v).as_text()

    assert "cudnn" not in hlo("reference").lower()
    assert "cudnn" in hlo("auto").lower()
