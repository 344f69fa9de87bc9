"""NaN and Inf stored where a kernel's contract says "ignored" never reach its output.

For every attention kernel with ignored positions (keys at or beyond kv_len, keys no row lists,
index-list padding past the count), K and V are filled with NaN, +Inf and -Inf at exactly those
positions, and index padding is pointed at them. The kernel and
its jnp reference must then both match a float64 numpy attention computed here from the clean
inputs over the valid positions only. `PoisonChecks` is written once: `TestPoisonInterpret` runs it in
Pallas interpret mode on CPU, where every output buffer starts as NaN (checked in test_kernels.py),
so a finite output also proves every element was written; `TestPoisonGPU` (marker `gpu`) compiles
the same cases with Triton. The LSE merge's contract (-inf valid, +inf / NaN invalid) closes the file.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from test_kernels import BF16, F32, LSE_TOL, O_TOL, index_lists, qkv

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Triton backend warns on use

POISON = np.array([np.nan, np.inf, -np.inf])


def attention_f64(q, k, v, allowed):
    """float64 softmax attention over the allowed keys only (allowed bool [B, Hq, Nq, Nk]):
    (o [B, Nq, Hq, D], lse [B, Hq, Nq]); a row with no allowed key gives o = 0 and lse = -inf."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    k, v = (np.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
    s = np.where(allowed, np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1]), -np.inf)
    m = s.max(-1)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.where(allowed, np.exp(s - m[..., None]), 0.0)
    total = e.sum(-1)
    o = np.einsum("bhqk,bkhd->bqhd", e / np.where(total > 0, total, 1.0)[..., None], v)
    return o, np.where(total > 0, m + np.log(np.where(total > 0, total, 1.0)), -np.inf)


def ignored_keys(allowed, num_kv_heads):
    """bool [B, Nk, Hkv]: keys that no query of any head in the KV head's group attends."""
    b, hq, nq, nk = allowed.shape
    used = allowed.reshape(b, num_kv_heads, hq // num_kv_heads * nq, nk).any(axis=2)
    return ~used.transpose(0, 2, 1)


def poisoned(x, ignored):
    """x [..., B, Nk, Hkv, D] with NaN / +Inf / -Inf (cycling along D) wherever ignored [B, Nk, Hkv]."""
    values = np.broadcast_to(POISON[np.arange(x.shape[-1]) % 3], x.shape)
    return jnp.asarray(np.where(ignored[..., None], values, np.asarray(x, np.float32)), x.dtype)


def point_padding_at(rng, idx, cnt, targets):
    """Index lists whose entries past the count point at random `targets` ([rows..., n] bool over
    the items of each row's KV head), or at out-of-range garbage (clamped by the kernels) when a row
    has no target."""
    idx, cnt = np.asarray(idx).copy(), np.asarray(cnt)
    for row in np.ndindex(cnt.shape):
        pad = np.arange(idx.shape[-1]) >= cnt[row]
        choices = np.flatnonzero(targets[row])
        fill = rng.choice(choices, pad.sum()) if choices.size else rng.integers(-50, 500, pad.sum())
        idx[row][pad] = fill
    return jnp.asarray(idx, jnp.int32)


def live_entries(idx, cnt):
    return np.arange(idx.shape[-1]) < np.asarray(cnt)[..., None]


def lengths_mask(kv_len, nk):
    return (np.arange(nk)[None, :] < np.asarray(kv_len)[:, None])[:, None, None, :]


def assert_matches_f64(out, expected, dtype):
    (o, lse), (o_ref, lse_ref) = out, expected
    o = np.asarray(o, np.float32)
    assert np.isfinite(o).all(), "poison (or an unwritten element) reached the output"
    err = np.abs(o - o_ref).max() / max(1.0, np.abs(o_ref).max())
    assert err <= O_TOL[dtype], f"output error {err:.2e} > {O_TOL[dtype]:.0e} against float64"
    lse = np.asarray(lse)
    assert not np.isnan(lse).any() and not np.isposinf(lse).any()
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref), err_msg="empty rows differ")
    live = np.isfinite(lse_ref)
    assert np.abs(lse[live] - lse_ref[live]).max(initial=0.0) <= LSE_TOL


class PoisonChecks:
    INTERPRET = False

    def check(self, kernel, reference, clean, poisoned_kv, expected_mask, dtype, *args, **kwargs):
        """kernel and reference on the poisoned K/V both match float64 attention on the clean ones."""
        q, k, v = clean
        expected = attention_f64(q, k, v, expected_mask)
        for fn, extra in ((kernel, {"interpret": self.INTERPRET}), (reference, {})):
            out = fn(q, *poisoned_kv, *args, return_lse=True, **extra, **kwargs)
            assert_matches_f64(out, expected, dtype)

    @pytest.mark.parametrize("dtype", [F32, BF16])
    def test_flash_keys_beyond_kv_len(self, rng, dtype):
        q, k, v = qkv(rng, 2, 20, 40, 2, 1, 32, dtype)  # GQA; 40 keys: a partial last tile
        kv_len = np.asarray([0, 21])                     # an empty row; a length inside a tile
        allowed = np.broadcast_to(lengths_mask(kv_len, 40), (2, 2, 20, 40))
        bad = ignored_keys(allowed, 1)
        self.check(pk.flash_attention, pk.flash_attention_reference, (q, k, v), (poisoned(k, bad), poisoned(v, bad)),
                   allowed, dtype, kv_len=jnp.asarray(kv_len), block_q=16, block_kv=16)

    @pytest.mark.parametrize("dtype", [F32, BF16])
    def test_split_kv_keys_beyond_kv_len(self, rng, dtype):
        q, k, v = qkv(rng, 2, 4, 60, 2, 1, 32, dtype)
        kv_len = np.asarray([0, 37])
        allowed = np.broadcast_to(lengths_mask(kv_len, 60), (2, 2, 4, 60))
        bad = ignored_keys(allowed, 1)
        run = dict(kv_len=jnp.asarray(kv_len), block_kv=16, num_splits=2)
        self.check(pk.split_kv_attention, pk.split_kv_attention_reference, (q, k, v),
                   (poisoned(k, bad), poisoned(v, bad)), allowed, dtype, **run)

    @pytest.mark.parametrize("dtype,per_kv_head", [(F32, False), (BF16, True)])
    def test_block_sparse_unlisted_blocks_and_keys_beyond_kv_len(self, rng, dtype, per_kv_head):
        b, nq, nk, hq, hkv, block_q, block_kv = 2, 20, 70, 2, 1, 16, 16
        q, k, v = qkv(rng, b, nq, nk, hq, hkv, 32, dtype)
        n_kb, n_qb, heads = -(-nk // block_kv), -(-nq // block_q), hkv if per_kv_head else hq
        idx, cnt = index_lists(rng, (b, heads, n_qb), n_kb - 2, 3)  # the last two blocks are listed by no row
        kv_len = np.asarray([nk, 37])                                 # inside a listed block
        blocks = np.zeros((b, heads, n_qb, n_kb), bool)
        for row in np.ndindex(cnt.shape):
            blocks[row][np.asarray(idx)[row][live_entries(idx, cnt)[row]]] = True
        blocks = np.repeat(blocks, hq // heads, axis=1)
        allowed = np.repeat(np.repeat(blocks, block_q, axis=2)[:, :, :nq], block_kv, axis=3)[..., :nk]
        allowed = allowed & lengths_mask(kv_len, nk)
        bad = ignored_keys(allowed, hkv)
        unlisted = ~blocks.reshape(b, hkv, hq // hkv * n_qb, n_kb).any(axis=2)  # by every row of a KV group
        unlisted = np.repeat(unlisted, heads // hkv, axis=1)
        idx = point_padding_at(rng, idx, cnt, np.repeat(unlisted[:, :, None], n_qb, axis=2))
        args = (idx, cnt)
        kwargs = dict(block_q=block_q, block_kv=block_kv, kv_len=jnp.asarray(kv_len))
        kv = (poisoned(k, bad), poisoned(v, bad))
        self.check(pk.block_sparse_attention, pk.block_sparse_attention_reference, (q, k, v), kv, allowed, dtype,
                   *args, **kwargs)
        if dtype == F32:  # SpargeAttn's stage 2 with the PV filter; a threshold of 50 never skips here: exact
            self.check(pk.pv_skip_attention, pk.pv_skip_attention_reference, (q, k, v), kv, allowed, dtype, *args,
                       pvthreshd=50.0, **kwargs)

    @pytest.mark.parametrize("dtype,per_kv_head", [(F32, True), (BF16, False)])
    def test_column_sparse_padding_entries(self, rng, dtype, per_kv_head):
        b, nq, nk, hq, hkv, group = 2, 20, 50, 2, 1, 16
        q, k, v = qkv(rng, b, nq, nk, hq, hkv, 32, dtype)
        n_g, heads = -(-nq // group), hkv if per_kv_head else hq
        idx, cnt = index_lists(rng, (b, heads, n_g), nk - 9, 20)  # the last 9 keys are listed by no row
        cols = np.zeros((b, heads, n_g, nk), bool)
        for row in np.ndindex(cnt.shape):
            cols[row][np.asarray(idx)[row][live_entries(idx, cnt)[row]]] = True
        allowed = np.repeat(np.repeat(cols, hq // heads, axis=1), group, axis=2)[:, :, :nq]
        bad = ignored_keys(allowed, hkv)
        targets = np.repeat(bad.transpose(0, 2, 1), hq // hkv, axis=1)[:, ::hq // heads][:, :, None]
        idx = point_padding_at(rng, idx, cnt, np.repeat(targets, n_g, axis=2))
        self.check(pk.column_sparse_attention, pk.column_sparse_attention_reference, (q, k, v),
                   (poisoned(k, bad), poisoned(v, bad)), allowed, dtype, idx, cnt, group_size=group, block_cols=16)

    @pytest.mark.parametrize("dtype", [F32, BF16])
    def test_split_kv_gather_padding_entries(self, rng, dtype):
        b, nq, nk, hq, hkv = 2, 4, 60, 4, 2
        q, k, v = qkv(rng, b, nq, nk, hq, hkv, 32, dtype)
        idx, cnt = index_lists(rng, (b, hkv), nk - 11, 24)  # rows with count 0 and 24; 11 keys never listed
        keys = np.zeros((b, hkv, nk), bool)
        for row in np.ndindex(cnt.shape):
            keys[row][np.asarray(idx)[row][live_entries(idx, cnt)[row]]] = True
        allowed = np.broadcast_to(np.repeat(keys, hq // hkv, axis=1)[:, :, None], (b, hq, nq, nk))
        bad = ignored_keys(allowed, hkv)
        idx = point_padding_at(rng, idx, cnt, bad.transpose(0, 2, 1))
        run = dict(block_kv=16, num_splits=2)
        kv = (poisoned(k, bad), poisoned(v, bad))
        self.check(pk.split_kv_gather_attention, pk.split_kv_gather_attention_reference, (q, k, v), kv, allowed,
                   dtype, idx, cnt, **run)

    def test_poison_at_an_attended_key_still_shows(self, rng):
        """Zeroing applies to ignored keys only: a NaN value a row attends still makes it non-finite."""
        q, k, v = qkv(rng, 1, 4, 64, 2, 2, 32, F32)
        v = v.at[0, 10, 0, 3].set(jnp.nan)
        for fn, extra in ((pk.split_kv_attention, {"interpret": self.INTERPRET}), (pk.split_kv_attention_reference, {})):
            o = np.asarray(fn(q, k, v, kv_len=jnp.asarray([40]), block_kv=16, **extra))
            assert np.isnan(o[0, :, 0, 3]).all()            # the attended NaN channel of head 0
            assert np.isfinite(np.delete(o[0, :, 0], 3, axis=-1)).all() and np.isfinite(o[0, :, 1]).all()


class TestPoisonInterpret(PoisonChecks):
    INTERPRET = True


@pytest.mark.gpu
class TestPoisonGPU(PoisonChecks):
    INTERPRET = False


# ---- merge_attention: an LSE of -inf is a valid empty part, +inf and NaN are invalid ----
def merge_inputs(rng):
    o1, o2 = (jnp.asarray(rng.standard_normal((1, 3, 2, 16)), F32) for _ in range(2))
    lse1 = jnp.asarray([[[0.5, -jnp.inf, 2.0], [-jnp.inf, 1.0, 0.0]]], F32)
    lse2 = jnp.asarray([[[1.0, 0.3, -jnp.inf], [-jnp.inf, 2.0, 1.5]]], F32)
    return o1, lse1, o2, lse2


@pytest.mark.parametrize("merge", [pk.merge_attention, pk.merge_attention_reference])
def test_merge_ignores_the_output_of_an_empty_part(rng, merge):
    o1, lse1, o2, lse2 = merge_inputs(rng)
    empty1 = np.isneginf(np.asarray(lse1)).transpose(0, 2, 1)[..., None]
    empty2 = np.isneginf(np.asarray(lse2)).transpose(0, 2, 1)[..., None]
    dirty1 = jnp.where(empty1, jnp.nan, o1)  # what a never-written partial buffer may hold
    dirty2 = jnp.where(empty2, jnp.inf, o2)
    o, lse = merge(dirty1, lse1, dirty2, lse2)
    l1, l2 = np.asarray(lse1, np.float64), np.asarray(lse2, np.float64)
    total = np.logaddexp(l1, l2)
    both_empty = empty1 & empty2
    w1, w2 = (np.exp(l - np.where(np.isfinite(total), total, 0.0)).transpose(0, 2, 1)[..., None] for l in (l1, l2))
    expected = np.where(both_empty, 0.0, w1 * np.asarray(o1, np.float64) + w2 * np.asarray(o2, np.float64))
    np.testing.assert_allclose(np.asarray(o), expected, atol=1e-6)
    np.testing.assert_array_equal(np.isneginf(lse), both_empty[..., 0].transpose(0, 2, 1))


@pytest.mark.parametrize("bad", [np.inf, np.nan])
@pytest.mark.parametrize("merge", [pk.merge_attention, pk.merge_attention_reference])
def test_merge_rejects_a_non_finite_lse(rng, merge, bad):
    o1, lse1, o2, lse2 = merge_inputs(rng)
    with pytest.raises(ValueError, match=r"lse2\[0, 1, 2\] = (inf|nan).*finite or -inf"):
        merge(o1, lse1, o2, lse2.at[0, 1, 2].set(bad))
    # inside jit the values cannot be checked: the bad row comes out NaN, the others are untouched
    o, lse = jax.jit(merge)(o1, lse1.at[0, 0, 1].set(bad), o2, lse2)
    good_o, good_lse = merge(o1, lse1, o2, lse2)
    o, lse, good_o, good_lse = (np.asarray(x) for x in (o, lse, good_o, good_lse))
    assert np.isnan(o[0, 1, 0]).all() and np.isnan(lse[0, 0, 1])
    keep = np.ones(lse.shape, bool)
    keep[0, 0, 1] = False
    np.testing.assert_allclose(lse[keep], good_lse[keep], rtol=1e-6)
    np.testing.assert_allclose(o.transpose(0, 2, 1, 3)[keep], good_o.transpose(0, 2, 1, 3)[keep], rtol=1e-6)
