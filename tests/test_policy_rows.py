"""Batched SDAR block steps at the policy level: rows at different positions (kv_len int32 [B]) and
rows in different modes (mode int32 [B]). Row b of a batched call must equal the batch-1 call of row
b with its own length and mode, and the exact modes must equal float64 attention over the row's keys.
Also Dense's backend switch (split-KV for kv_len-only calls) and `switch_rows` itself."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.attention.flashblock import FlashBlock
from dllm_jax.attention.mage import MAGE, block_attention, selection_of
from dllm_jax.attention import backends
from dllm_jax.attention.policy import Dense, Mode, switch_rows
from sdar_methods_testing import masked_attention

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

N, HQ, HKV, D, CAP = 4, 4, 2, 16, 48
PREFIXES = (30, 5, 17, 0)  # row 1's prefix is shorter than MAGE's k = 8; row 3 has none


def inputs(rng, batch):
    q = jnp.asarray(rng.standard_normal((batch, N, HQ, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((batch, CAP, HKV, D)), jnp.float32) for _ in range(2))
    return q, k, v


def lengths(batch):
    return jnp.asarray([p + N for p in PREFIXES[:batch]], jnp.int32)


def row_of(tree, b):
    """Row b (kept as a batch of one) of every leaf with a batch axis; scalars (MAGE's exact flag) as they are."""
    return jax.tree.map(lambda x: x[b:b + 1] if jnp.ndim(x) else x, tree)


def assert_rows_match_single_calls(policy, q, k, v, state, mode, kv_len):
    """policy.attend on the batch equals, row by row, the batch-1 call with the row's scalar mode and
    length (output and new state); returns the batched (out, state)."""
    attend = jax.jit(policy.attend)  # one compilation for the batch, one for all the single rows
    out, new = attend(q, k, v, state, jnp.asarray(mode, jnp.int32), kv_len=kv_len)
    modes = np.broadcast_to(np.asarray(mode), (q.shape[0],))
    for b in range(q.shape[0]):
        one_out, one_new = attend(row_of(q, b), row_of(k, b), row_of(v, b), row_of(state, b),
                                         jnp.int32(modes[b]), kv_len=jnp.int32(kv_len[b]))
        np.testing.assert_allclose(out[b:b + 1], one_out, atol=1e-6, err_msg=f"row {b}, mode {modes[b]}")
        jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6, err_msg=f"state of row {b}"),
                     row_of(new, b), one_new)
    return out, new


def assert_exact(out, q, k, v, kv_len, rows):
    for b in rows:
        expected = masked_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], np.arange(CAP) < int(kv_len[b]))
        np.testing.assert_allclose(out[b:b + 1], expected, atol=1e-5, err_msg=f"row {b} is not exact")


def assert_rows_unchanged(new, old, rows):
    for b in rows:
        jax.tree.map(lambda x, y: np.testing.assert_array_equal(x, y, err_msg=f"row {b}'s state changed"),
                     row_of(new, b), row_of(old, b))


def init(policy, batch):
    return policy.init_state(batch=batch, num_heads=HQ, num_kv_heads=HKV, q_len=N, kv_len=CAP, head_dim=D)


@pytest.mark.parametrize("backend", ["reference", "interpret"])
def test_block_attention_is_over_each_rows_own_block(rng, backend):
    """The block part MAGE and FlashBlock merge with the prefix part: attention over rows [kv_len - n, kv_len) of
    each row's cache, read in place, with its LSE (float64 references over the row's block keys alone)."""
    q, k, v = inputs(rng, 4)
    kv_len = lengths(4)
    o, lse = block_attention(q, k, v, kv_len, backend)
    for b in range(4):
        block = (np.arange(CAP) >= int(kv_len[b]) - N) & (np.arange(CAP) < int(kv_len[b]))
        expected = masked_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], block)
        np.testing.assert_allclose(o[b:b + 1], expected, atol=1e-5, err_msg=f"row {b}")
        s = np.einsum("nhd,khd->hnk", np.float64(q[b]), np.float64(np.repeat(k[b][block], HQ // HKV, axis=1)))
        np.testing.assert_allclose(lse[b], np.log(np.exp(s / np.sqrt(D)).sum(-1)), atol=1e-5)


def test_mage_rows_at_different_positions_and_in_different_modes(rng):
    mage = MAGE(k=8, exact_layers=0)
    q0, k, v = inputs(rng, 3)
    q1 = jnp.asarray(rng.standard_normal(q0.shape), jnp.float32)
    kv_len = lengths(3)
    # the first step of every row's block (a scalar mode), each row with its own prefix
    out, state = assert_rows_match_single_calls(mage, q0, k, v, init(mage, 3), Mode.ESTIMATE, kv_len)
    assert_exact(out, q0, k, v, kv_len, range(3))
    # a short prefix: all kept
    np.testing.assert_array_equal(state[0].indices[1, :, :5], np.broadcast_to(np.arange(5), (HKV, 5)))
    # a uniform per-row mode, then mixed modes: a sparse row, a row starting a block, an exact row
    assert_rows_match_single_calls(mage, q1, k, v, state, [Mode.SPARSE] * 3, kv_len)
    mixed = [Mode.SPARSE, Mode.ESTIMATE, Mode.DENSE]
    out, new = assert_rows_match_single_calls(mage, q1, k, v, state, mixed, kv_len)
    assert_exact(out, q1, k, v, kv_len, [1, 2])
    assert_rows_unchanged(new, state, [0, 2])  # SPARSE and DENSE keep the selection


def test_mage_exact_layer_stays_exact_in_every_row_mode(rng):
    mage = MAGE(k=4, exact_layers=1)
    q, k, v = inputs(rng, 3)
    kv_len = lengths(3)
    indices = jnp.asarray(rng.integers(0, 5, (3, HKV, 4)), jnp.int32)
    state = (selection_of(indices, kv_len, N), jnp.bool_(True))
    out, new = mage.attend(q, k, v, state, jnp.asarray([Mode.SPARSE, Mode.ESTIMATE, Mode.DENSE], jnp.int32),
                           kv_len=kv_len)
    assert_exact(out, q, k, v, kv_len, range(3))
    jax.tree.map(np.testing.assert_array_equal, new[0], state[0])


@pytest.mark.parametrize("inner", [None, MAGE(k=8, exact_layers=0)])
def test_flashblock_rows_at_different_positions_and_in_different_modes(rng, inner):
    fb = FlashBlock(tau=2, inner=inner)
    q0, k, v = inputs(rng, 4)
    q1 = jnp.asarray(rng.standard_normal(q0.shape), jnp.float32)
    kv_len = lengths(4)
    out, state = assert_rows_match_single_calls(fb, q0, k, v, init(fb, 4), [Mode.ESTIMATE] * 4, kv_len)
    assert_exact(out, q0, k, v, kv_len, range(4))
    # the block's own keys change between steps, as unmasking does
    block_rows = (np.arange(CAP) >= np.asarray(kv_len)[:, None] - N) & (np.arange(CAP) < np.asarray(kv_len)[:, None])
    k1 = jnp.where(block_rows[:, :, None, None], jnp.asarray(rng.standard_normal(k.shape), jnp.float32), k)
    mixed = [Mode.SPARSE, Mode.REFRESH, Mode.DENSE, Mode.ESTIMATE]
    out, new = assert_rows_match_single_calls(fb, q1, k1, v, state, mixed, kv_len)
    exact_rows = [1, 2, 3] if inner is None else [2, 3]  # with MAGE, REFRESH attends the selection + residual
    assert_exact(out, q1, k1, v, kv_len, exact_rows)
    assert_rows_unchanged(new, state, [0, 2])  # reuse and the commit forward keep the cached part
    if inner is None:  # the reuse row used its stale part: not the exact attention of its new queries
        assert np.abs(np.asarray(out[0]) - masked_attention(q1[:1], k1[:1], v[:1], np.arange(CAP) < int(kv_len[0]))
                      ).max() > 1e-3


def test_per_row_modes_match_with_the_interpret_kernels(rng):
    """The Pallas kernels (interpret mode) under per-row lengths and modes give the references' result."""
    q, k, v = inputs(rng, 3)
    kv_len = lengths(3)
    mixed = jnp.asarray([Mode.SPARSE, Mode.ESTIMATE, Mode.DENSE], jnp.int32)
    state = (selection_of(jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (3, HKV, 8)), kv_len, N),
             jnp.bool_(False))
    results = [jax.jit(MAGE(k=8, exact_layers=0, backend=backend).attend)(q, k, v, state, mixed, kv_len=kv_len)
               for backend in ("reference", "interpret")]
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=2e-5), *results)


def test_flashblock_block_mode_per_row():
    fb = FlashBlock(tau=2)
    unmasked = jnp.asarray([0, 1, 2, 5], jnp.int32)
    mode = fb.block_mode(jnp.int32(2), unmasked=unmasked, commit=jnp.bool_(False))
    assert mode.dtype == jnp.int32 and mode.tolist() == [Mode.SPARSE, Mode.SPARSE, Mode.REFRESH, Mode.REFRESH]
    assert fb.block_mode(jnp.int32(0), unmasked=unmasked, commit=False).tolist() == [Mode.ESTIMATE] * 4
    assert fb.block_mode(jnp.int32(3), unmasked=unmasked, commit=jnp.bool_(True)).tolist() == [Mode.DENSE] * 4
    never = FlashBlock(tau=None).block_mode(jnp.int32(3), unmasked=unmasked, commit=False)
    assert never.tolist() == [Mode.SPARSE] * 4
    steps = jnp.asarray([0, 2, 2, 3], jnp.int32)  # rows at different steps of their blocks
    assert fb.block_mode(steps, unmasked=unmasked, commit=False).tolist() == [
        Mode.ESTIMATE, Mode.SPARSE, Mode.REFRESH, Mode.REFRESH]


def test_switch_rows_runs_only_the_branches_some_row_needs():
    ran = []

    def branch(m):
        def run(x):
            jax.debug.callback(lambda: ran.append(m))
            return x * 10 + m, (x[:, 0] + m,)
        return run

    run = jax.jit(lambda index, x: switch_rows(index, [branch(m) for m in range(3)], x))
    x = jnp.arange(6.0).reshape(3, 2)
    for index, expected_runs in (([2, 2, 2], [2]), ([0, 2, 0], [0, 2]), ([1, 0, 2], [0, 1, 2])):
        ran.clear()
        out, (first,) = run(jnp.asarray(index, jnp.int32), x)
        jax.effects_barrier()
        assert sorted(ran) == expected_runs
        m = np.asarray(index)[:, None]
        np.testing.assert_array_equal(out, np.asarray(x) * 10 + m)
        np.testing.assert_array_equal(first, np.asarray(x)[:, 0] + m[:, 0])
    scalar = switch_rows(jnp.int32(1), [branch(m) for m in range(3)], x)[0]  # a scalar index: a plain switch
    np.testing.assert_array_equal(scalar, np.asarray(x) * 10 + 1)
    one_row = switch_rows(jnp.asarray([2], jnp.int32), [branch(m) for m in range(3)], x[:1])[0]
    np.testing.assert_array_equal(one_row, np.asarray(x[:1]) * 10 + 2)
    # a Python int (a mode known while tracing): its branch alone, no conditional in the program
    static = jax.make_jaxpr(lambda x: switch_rows(2, [branch(m) for m in range(3)], x))(x)
    assert "cond" not in {eqn.primitive.name for eqn in static.jaxpr.eqns}
    ran.clear()
    np.testing.assert_array_equal(jax.jit(lambda x: switch_rows(2, [branch(m) for m in range(3)], x))(x)[0],
                                  np.asarray(x) * 10 + 2)
    jax.effects_barrier()
    assert ran == [2]


def test_dense_split_kv_equals_xla_on_rows_of_different_lengths(rng):
    q, k, v = inputs(rng, 3)
    kv_len = lengths(3)
    split, _ = Dense("interpret").attend(q, k, v, (), Mode.DENSE, kv_len=kv_len)  # the split-KV kernel
    xla, _ = Dense("xla").attend(q, k, v, (), Mode.DENSE, kv_len=kv_len)
    np.testing.assert_allclose(split, xla, atol=1e-6)
    assert_exact(split, q, k, v, kv_len, range(3))
    auto, _ = Dense().attend(q, k, v, (), Mode.DENSE, kv_len=kv_len)  # CPU: dense_attention, as before
    np.testing.assert_allclose(auto, xla, atol=1e-6)


def uses_split_kv(backend, q, k, **masks):
    return backends.dense(backend, q, k, **masks)[0] == "split_kv"


def test_dense_backend_choice_and_bad_names(rng):
    q, k, _ = inputs(rng, 2)
    kv_len = lengths(2)
    assert uses_split_kv("triton", q, k, kv_len=kv_len)
    assert not uses_split_kv("triton", q, k, kv_len=kv_len, mask=jnp.ones((N, CAP), bool))  # the prefill
    assert not uses_split_kv("triton", q, k)  # no KV cache (LLaDA)
    assert not uses_split_kv("xla", q, k, kv_len=kv_len) and not uses_split_kv("cudnn", q, k, kv_len=kv_len)
    assert not uses_split_kv("reference", q, k, kv_len=kv_len)
    if jax.default_backend() != "gpu":
        assert not uses_split_kv("auto", q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), kv_len=kv_len)
    assert Dense() == Dense() and hash(Dense()) == hash(Dense("auto")) and Dense("xla") != Dense()
    assert dataclasses.replace(Dense(), backend="cudnn").backend == "cudnn"
    for bad in ("flash", "", "XLA", "split_kv", "pallas"):
        with pytest.raises(ValueError, match=f"backend='{bad}'"):
            Dense(bad)


@pytest.mark.gpu
def test_dense_auto_takes_the_split_kv_kernel_on_gpu(rng):
    """At SDAR-8B head shapes in bf16, Dense() routes a block step through the Pallas split-KV kernel
    and matches cuDNN; the prefill's masked call stays on dense_attention."""
    b, n, hq, hkv, d, cap = 3, 4, 32, 8, 128, 4096
    q = jnp.asarray(rng.standard_normal((b, n, hq, d)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.standard_normal((b, cap, hkv, d)), jnp.bfloat16) for _ in range(2))
    kv_len = jnp.asarray([4000, 17, 1500], jnp.int32)
    assert uses_split_kv("auto", q, k, kv_len=kv_len)
    assert not uses_split_kv("auto", q, k, kv_len=kv_len, mask=jnp.ones((n, cap), bool))
    auto = jax.jit(Dense().attend)(q, k, v, (), Mode.DENSE, kv_len=kv_len)[0]
    cudnn = jax.jit(Dense("cudnn").attend)(q, k, v, (), Mode.DENSE, kv_len=kv_len)[0]
    auto, cudnn = np.asarray(auto, np.float32), np.asarray(cudnn, np.float32)
    assert np.isfinite(auto).all()
    assert np.linalg.norm(auto - cudnn) / np.linalg.norm(cudnn) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("inner", [None, MAGE(k=256, exact_layers=0)])
def test_pallas_per_row_modes_match_the_reference_on_gpu(rng, inner):
    """Rows at different positions and in different modes through the Pallas kernels (bf16, SDAR-8B
    head shapes) against the jnp references."""
    b, n, hq, hkv, d, cap = 4, 4, 32, 8, 128, 4096
    k, v = (jnp.asarray(rng.standard_normal((b, cap, hkv, d)), jnp.bfloat16) for _ in range(2))
    kv_len = jnp.asarray([4000, 100, 2500, 300], jnp.int32)
    q0, q1 = (jnp.asarray(rng.standard_normal((b, n, hq, d)), jnp.bfloat16) for _ in range(2))
    mixed = jnp.asarray([Mode.SPARSE, Mode.REFRESH, Mode.DENSE, Mode.ESTIMATE], jnp.int32)
    results = {}
    for backend in ("auto", "reference"):
        fb = FlashBlock(tau=2, inner=None if inner is None else dataclasses.replace(inner, backend=backend),
                        backend=backend)
        state = fb.init_state(batch=b, num_heads=hq, num_kv_heads=hkv, q_len=n, kv_len=cap, head_dim=d)
        attend = jax.jit(fb.attend)
        _, state = attend(q0, k, v, state, jnp.full((b,), Mode.ESTIMATE, jnp.int32), kv_len=kv_len)
        results[backend] = np.asarray(attend(q1, k, v, state, mixed, kv_len=kv_len)[0], np.float32)
    got, expected = results["auto"], results["reference"]
    assert np.isfinite(got).all()
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 2e-2
