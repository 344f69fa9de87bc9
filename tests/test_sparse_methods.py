"""SparseD and PulseCol: pattern selection against straightforward numpy versions of the published
rules, sparse attention against dense attention under the same explicit mask, and generation with
everything kept against dense generation."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from dllm_jax import PulseCol, SpargeAttn, SparseD, generate
from dllm_jax.attention.policy import Mode
from dllm_jax.attention.pulsecol import num_keep, refresh_steps, select_columns
from dllm_jax.attention.sparsed import select_blocks
from dllm_jax.testing import tiny_llada_config

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def top(scores, k):
    """Indices of the k largest entries, ties to the lower index (as lax.top_k)."""
    return np.argsort(-scores, kind="stable")[:k]


def sparsed_numpy(q, k, prefill_len, b, rho, scale):
    """SparseD's mask [B, H, nb, nb] from the rules in docs/methods.md §1, one (batch, head) at a time."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    bsz, n, hq, _ = q.shape
    k = np.repeat(k, hq // k.shape[2], axis=2)
    nb = math.ceil(n / b)
    last = next((j for j in range(nb) if n - j * b <= n - prefill_len), nb - 1)
    nb_g = math.ceil((n - last * b) / b)
    k_a, k_b = min(nb, max(1, math.floor(nb * rho) + 1)), min(nb_g, max(1, math.floor(nb_g * rho) + 1))
    out = np.zeros((bsz, hq, nb, nb), bool)
    for bi in range(bsz):
        for h in range(hq):
            s = q[bi, :, h] @ k[bi, :, h].T * scale
            for part, cols_from, keep in ((0, 0, k_a), (1, last * b, k_b)):
                p = softmax(s[:, cols_from:])
                pad = np.zeros((nb * b, math.ceil(p.shape[1] / b) * b))
                pad[:n, :p.shape[1]] = p
                pooled = pad.reshape(nb, b, -1, b).mean(axis=(1, 3))
                for j in range(nb):
                    chosen = top(pooled[j], keep)
                    # pass A drops the generation columns it picked; pass B's columns start at `last`
                    out[bi, h, j, chosen[chosen < last] if part == 0 else chosen + last] = True
    return out


def lists_to_mask(idx, cnt, n_cols):
    idx, cnt = np.asarray(idx), np.asarray(cnt)
    mask = np.zeros(idx.shape[:-1] + (n_cols,), bool)
    for pos in np.ndindex(idx.shape[:-1]):
        mask[pos][idx[pos][:cnt[pos]]] = True
    return mask


def random_qk(rng, b, n, hq, hkv, d, dtype=jnp.float32):
    return (jnp.asarray(rng.standard_normal((b, n, hq, d)), dtype),
            jnp.asarray(rng.standard_normal((b, n, hkv, d)), dtype))


@pytest.mark.parametrize("n,prefill,block,rho,hkv", [
    (100, 37, 16, 0.3, 2),    # the prompt ends inside a block (boundary block counts as prefill), tail block
    (96, 32, 32, 0.5, 4),     # the prompt ends on a block boundary
    (20, 12, 32, 0.3, 4),     # a single block: shorter than the block size
    (70, 60, 16, 1.0, 1),     # select = 1 keeps every block; MQA
    (64, 0, 16, 0.2, 2),      # no prompt
])
def test_select_blocks_matches_the_published_rules(rng, n, prefill, block, rho, hkv):
    q, k = random_qk(rng, 2, n, 4, hkv, 16)
    idx, cnt = select_blocks(q, k, prefill_len=prefill, block_size=block, select=rho)
    nb = -(-n // block)
    got = lists_to_mask(idx, cnt, nb)
    expected = sparsed_numpy(q, k, prefill, block, rho, 16 ** -0.5)
    np.testing.assert_array_equal(got, expected)
    assert np.all(np.diff(np.asarray(idx), axis=-1) >= 0), "indices must be ascending"
    if rho == 1.0:
        assert got.all()


def test_sparsed_scale_quirk_scores_with_num_heads(rng):
    q, k = random_qk(rng, 1, 64, 4, 4, 16)
    quirk = select_blocks(q, k, prefill_len=30, block_size=16, select=0.3, scale=4 ** -0.5)
    np.testing.assert_array_equal(lists_to_mask(*quirk, 4), sparsed_numpy(q, k, 30, 16, 0.3, 0.5))


def test_refresh_steps_follow_the_paper():
    def numpy_rule(t, eta, r):
        window = max(1, math.floor(eta * t))
        if r == 1:
            return (1,)
        return tuple(np.unique(1 + np.floor(np.arange(r) * (window - 1) / (r - 1)).astype(int)).tolist())

    for t, eta, r in [(128, 0.3, 16), (1024, 0.3, 16), (256, 0.3, 8), (64, 0.5, 1), (10, 0.3, 16), (3, 0.1, 4)]:
        assert refresh_steps(t, eta, r) == numpy_rule(t, eta, r)
    steps = refresh_steps(128, 0.3, 16)  # T_win = 38
    assert steps[0] == 1 and steps[-1] == 38 and len(steps) == 16


@pytest.mark.parametrize("n,group,sparsity,hkv", [(100, 32, 0.8, 2), (40, 16, 0.5, 4), (20, 32, 0.0, 1)])
def test_select_columns_matches_the_published_rule(rng, n, group, sparsity, hkv):
    q, k = random_qk(rng, 2, n, 4, hkv, 16)
    keep = num_keep(n, sparsity)
    idx, cnt = select_columns(q, k, group_size=group, num_keep=keep)
    qn, kn = np.asarray(q, np.float64), np.repeat(np.asarray(k, np.float64), 4 // hkv, axis=2)
    for b in range(2):
        for h in range(4):
            p = softmax(qn[b, :, h] @ kn[b, :, h].T / 4.0)
            for u in range(-(-n // group)):
                score = p[u * group:(u + 1) * group].mean(0)
                assert set(np.asarray(idx[b, h, u]).tolist()) == set(top(score, keep).tolist())
    np.testing.assert_array_equal(cnt, keep)
    assert np.all(np.diff(np.asarray(idx), axis=-1) > 0)


def masked_attention(q, k, v, mask):
    """float64 softmax attention of q [B, N, H, D] under a per-head bool mask [B, H, N, S]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = (np.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    p = softmax(np.where(np.asarray(mask), s, -np.inf))
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def test_sparse_attention_equals_dense_under_the_explicit_mask(rng):
    q, k = random_qk(rng, 2, 90, 4, 2, 16)
    v = jnp.asarray(rng.standard_normal(k.shape), jnp.float32)
    sparsed = SparseD(select=0.3, block_size=16).bind(total_steps=10, prompt_length=50)
    state = select_blocks(q, k, prefill_len=50, block_size=16, select=0.3)
    out, _ = sparsed.attend(q, k, v, state, jnp.int32(Mode.SPARSE))
    mask = pk.block_sparse.block_mask(*state, block_q=16, block_kv=16, num_queries=90, num_keys=90, num_heads=4)
    np.testing.assert_allclose(out, masked_attention(q, k, v, mask), atol=1e-5)

    pulsecol = PulseCol(sparsity=0.7, group_size=16).bind(total_steps=10)
    state = select_columns(q, k, group_size=16, num_keep=num_keep(90, 0.7))
    out, _ = pulsecol.attend(q, k, v, state, jnp.int32(Mode.SPARSE))
    mask = pk.column_sparse.column_mask(*state, group_size=16, num_queries=90, num_keys=90, num_heads=4)
    np.testing.assert_allclose(out, masked_attention(q, k, v, mask), atol=1e-5)


def test_schedules():
    sparsed = SparseD(skip=0.2).bind(total_steps=128, prompt_length=10)
    modes = [int(sparsed.mode(jnp.int32(t))) for t in range(128)]
    assert modes[:26] == [Mode.DENSE] * 26 and modes[26] == Mode.ESTIMATE and set(modes[27:]) == {Mode.SPARSE}
    pulsecol = PulseCol(eta=0.3, refreshes=16).bind(total_steps=128)
    estimate = [t + 1 for t in range(128) if int(pulsecol.mode(jnp.int32(t))) == Mode.ESTIMATE]
    assert tuple(estimate) == refresh_steps(128, 0.3, 16)


def test_bad_configs_raise():
    for make in (lambda: SparseD(select=0.0), lambda: SparseD(block_size=48), lambda: SparseD(skip=1.0),
                 lambda: PulseCol(sparsity=1.0), lambda: PulseCol(group_size=8), lambda: SparseD(backend="cuda")):
        with pytest.raises(ValueError):
            make()
    with pytest.raises(ValueError, match="step count"):
        SparseD().mode(0)


OPTIONS = dict(gen_length=32, steps=8, block_length=16)


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(tiny_llada_config(vocab_size=48, tokenizer_vocab_size=48, mask_token_id=40, eos_token_id=41,
                                        pad_token_id=41, eot_token_id=42), seed=3)


def test_keeping_everything_equals_dense_generation(model, rng):
    """select = 1.0 and sparsity 0 keep every key: the sparse steps (steps 2.. of 8) must not change a token."""
    for _ in range(2):
        prompt = rng.integers(0, 40, (2, 20))
        dense = generate(model, prompt, **OPTIONS)
        np.testing.assert_array_equal(generate(model, prompt, method=SparseD(select=1.0, block_size=16), **OPTIONS),
                                      dense)
        np.testing.assert_array_equal(generate(model, prompt, method=PulseCol(sparsity=0.0, group_size=16, refreshes=2),
                                               **OPTIONS), dense)


def test_sparse_methods_run_in_the_jitted_loop_with_the_kernels(model, rng):
    """With the Pallas kernels in interpret mode the loop gives what the jnp references give."""
    prompt = rng.integers(0, 40, (1, 20))
    for method in (SparseD(select=0.3, block_size=16), PulseCol(sparsity=0.8, group_size=16, refreshes=2)):
        reference = generate(model, prompt, method=method, **OPTIONS)
        interpreted = generate(model, prompt, method=dataclasses.replace(method, backend="interpret"), **OPTIONS)
        np.testing.assert_array_equal(interpreted, reference)


def test_padding_mask_is_rejected(model, rng):
    prompt = rng.integers(0, 40, (2, 20))
    mask = np.ones_like(prompt)
    mask[0, :3] = 0
    with pytest.raises(ValueError, match="does not support attention masks"):
        generate(model, prompt, attention_mask=mask, padding="mask", method=SparseD(block_size=16), **OPTIONS)


def test_analysis_of_a_generation(model, rng):
    import matplotlib

    matplotlib.use("Agg")
    from dllm_jax.analysis import analyze, plot_error, plot_head_patterns, plot_jaccard, plot_recall

    prompt = rng.integers(0, 40, (1, 20))
    method = SparseD(select=0.3, block_size=16)
    report = analyze(model, prompt, method, **OPTIONS)
    # the probe observes without changing anything
    np.testing.assert_array_equal(report.tokens, generate(model, prompt, method=method, **OPTIONS))
    layers, steps = model.config.num_layers, OPTIONS["steps"]
    assert report.recall.shape == report.l1.shape == (layers, steps, 1, model.config.num_heads)
    sparse = report.modes == Mode.SPARSE
    assert sparse.sum() == steps - (int(steps * 0.2) + 2)
    np.testing.assert_array_equal(report.recall[:, ~sparse], 1.0)   # dense steps keep every key
    np.testing.assert_allclose(report.l1[:, ~sparse], 0.0, atol=1e-5)
    assert (report.l1[:, sparse] > 0).all() and (report.recall[:, sparse] < 1).any()
    assert np.isnan(report.jaccard[:, 0]).all() and ((report.jaccard[:, 1:] >= 0) & (report.jaccard[:, 1:] <= 1)).all()
    full = analyze(model, prompt, SparseD(select=1.0, block_size=16), **OPTIONS)
    np.testing.assert_array_equal(full.recall, 1.0)
    np.testing.assert_allclose(full.l1, 0.0, atol=1e-5)
    for plot in (plot_recall, plot_jaccard, plot_error):
        assert plot(report).get_title()
    # per-head snapshot at the first sparse step: N < 64, so one cell per (query, key)
    n = prompt.shape[1] + OPTIONS["gen_length"]
    assert report.snapshot_step == int(np.flatnonzero(sparse)[0])
    assert report.attention.shape == report.kept.shape == (layers, 1, model.config.num_heads, n, n)
    np.testing.assert_allclose(report.attention.sum(-1), 1.0, rtol=1e-5)
    assert set(np.unique(report.kept)) == {0.0, 1.0} and 0 < report.kept.mean() < 1
    np.testing.assert_array_equal(full.kept, 1.0)
    assert len(plot_head_patterns(report, layer=1, heads=[0, 1]).axes) == 5  # 2 x 2 maps + colour bar
    with pytest.raises(ValueError, match="layer=9"):
        plot_head_patterns(report, layer=9)


def test_analysis_of_a_method_without_a_pattern_mask(model, rng):
    from dllm_jax.analysis import analyze

    report = analyze(model, rng.integers(0, 40, (1, 20)), SpargeAttn(topk=0.5, block_q=16, block_kv=16),
                     **OPTIONS)
    assert np.isnan(report.recall).all() and np.isnan(report.kept).all()
    assert (report.l1 > 0).any() and np.isfinite(report.l1).all()
