"""Every Pallas kernel against its dense reference on fresh random inputs.

`KernelChecks` is written once; `TestKernelsInterpret` runs it in Pallas interpret mode on CPU (CI)
and `TestKernelsGPU` (marker `gpu`) compiles the same cases with Triton on the device. Interpret
mode starts every output buffer as NaN (`test_interpret_outputs_start_poisoned` checks this), so a
finite output that matches the reference proves every element was written.
"""

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import pallas_kernels as pk
from pallas_kernels import split_kv
from dllm_jax.attention import kv_rows
from dllm_jax.testing import jaxpr_equations

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the Triton backend warns on use

F32, BF16 = jnp.float32, jnp.bfloat16
O_TOL = {F32: 2e-5, BF16: 2e-2}  # max |o - ref| / max(1, max |ref|)
LSE_TOL = 2e-4
SCORE_TOL = 1e-5  # max |score - ref| / max |ref|


LOGITS_CASES = [  # the split-KV pass storing its logits (as float32 or float16 probabilities)
    (4, 4, 2, 300, [0, 217], 3),     # an empty cache row, a length inside a tile
    (4, 4, 2, 300, [300, 290], 3),   # the last tile loaded from below its start (capacity 9.4 tiles)
    (4, 2, 1, 20, [20, 7], 2),       # a capacity below one tile (padded to one)
    (5, 8, 2, 100, None, 4),         # G * Nq = 20 rows, folded into a tile of 32
]


def qkv(rng, b, nq, nk, hq, hkv, d, dtype):
    q = jnp.asarray(rng.standard_normal((b, nq, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((b, nk, hkv, d)), dtype)
    v = jnp.asarray(rng.standard_normal((b, nk, hkv, d)), dtype)
    return q, k, v


def index_lists(rng, lead, items, width, *, garbage=True):
    """Distinct ascending picks from range(items) per row, padded to `width` with garbage (any ints,
    in or out of range) beyond a random count; the first row gets count 0 and the second `width`."""
    rows = int(np.prod(lead))
    idx = np.empty((rows, width), np.int64)
    counts = rng.integers(0, width + 1, rows)
    counts[0] = 0
    if rows > 1:
        counts[1] = width
    for r in range(rows):
        idx[r] = np.sort(rng.choice(items, width, replace=False))
        if garbage:
            idx[r, counts[r]:] = rng.integers(-3 * items, 3 * items, width - counts[r])
    return jnp.asarray(idx.reshape(*lead, width), jnp.int32), jnp.asarray(counts.reshape(lead), jnp.int32)


def assert_attention_close(out, ref, dtype):
    (o, lse), (o_ref, lse_ref) = out, ref
    o, o_ref = np.asarray(o, np.float32), np.asarray(o_ref, np.float32)
    assert np.isfinite(o).all(), "output has unwritten (NaN) or non-finite elements"
    err = np.abs(o - o_ref).max() / max(1.0, np.abs(o_ref).max())
    assert err <= O_TOL[dtype], f"output error {err:.2e} > {O_TOL[dtype]:.0e}"
    lse, lse_ref = np.asarray(lse), np.asarray(lse_ref)
    assert lse.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref), err_msg="empty rows differ")
    live = np.isfinite(lse_ref)
    assert np.isfinite(lse[live]).all()
    assert np.abs(lse[live] - lse_ref[live]).max(initial=0.0) <= LSE_TOL


def assert_scores_close(out, ref):
    out, ref = np.asarray(out), np.asarray(ref)
    assert out.shape == ref.shape and np.isfinite(out).all()
    err = np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)
    assert err <= SCORE_TOL, f"score error {err:.2e}"


class KernelChecks:
    INTERPRET = False

    def both(self, kernel, reference, *args, **kwargs):
        out = kernel(*args, return_lse=True, interpret=self.INTERPRET, **kwargs)
        return out, reference(*args, return_lse=True, **kwargs)

    # ---- flash ----
    @pytest.mark.parametrize("dtype", [F32, BF16])
    @pytest.mark.parametrize("b,nq,nk,hq,hkv,d,kv_len", [
        (2, 40, 70, 4, 2, 64, None),        # tails on both axes, GQA
        (1, 16, 16, 2, 2, 128, None),       # a single tile
        (2, 33, 100, 4, 1, 128, [0, 57]),   # MQA, an empty row, a length inside a tile
        (1, 50, 96, 2, 2, 64, 64),          # a length on a tile boundary
    ])
    def test_flash(self, rng, dtype, b, nq, nk, hq, hkv, d, kv_len):
        q, k, v = qkv(rng, b, nq, nk, hq, hkv, d, dtype)
        lengths = None if kv_len is None else jnp.asarray(kv_len)
        out, ref = self.both(pk.flash_attention, pk.flash_attention_reference, q, k, v, kv_len=lengths,
                             block_q=16, block_kv=32)
        assert_attention_close(out, ref, dtype)

    def test_flash_default_tiles(self, rng):
        q, k, v = qkv(rng, 1, 200, 300, 2, 1, 64, BF16)
        out, ref = self.both(pk.flash_attention, pk.flash_attention_reference, q, k, v)
        assert_attention_close(out, ref, BF16)

    # ---- block-sparse ----
    @pytest.mark.parametrize("dtype", [F32, BF16])
    @pytest.mark.parametrize("per_kv_head", [False, True])
    @pytest.mark.parametrize("block_q,block_kv,nq,nk", [(32, 32, 70, 100), (64, 16, 64, 64), (16, 64, 20, 130)])
    def test_block_sparse(self, rng, dtype, per_kv_head, block_q, block_kv, nq, nk):
        b, hq, hkv, d = 2, 4, 2, 64
        q, k, v = qkv(rng, b, nq, nk, hq, hkv, d, dtype)
        n_kb = -(-nk // block_kv)
        idx, cnt = index_lists(rng, (b, hkv if per_kv_head else hq, -(-nq // block_q)), n_kb, n_kb)
        out, ref = self.both(pk.block_sparse_attention, pk.block_sparse_attention_reference, q, k, v, idx, cnt,
                             block_q=block_q, block_kv=block_kv, kv_len=jnp.asarray([nk, nk - 7]))
        assert_attention_close(out, ref, dtype)

    @pytest.mark.parametrize("preload", [False, True])
    def test_block_sparse_128_blocks_head_dim_128(self, rng, preload):
        q, k, v = qkv(rng, 1, 256, 300, 2, 2, 128, BF16)
        idx, cnt = index_lists(rng, (1, 2, 2), 3, 2)
        out, ref = self.both(pk.block_sparse_attention, pk.block_sparse_attention_reference, q, k, v, idx, cnt,
                             block_q=128, block_kv=128, preload_indices=preload)
        assert_attention_close(out, ref, BF16)

    @pytest.mark.parametrize("seed", range(3))
    def test_block_sparse_random_patterns(self, seed):
        rng = np.random.default_rng(1000 + seed)
        hkv = int(rng.choice([1, 2]))
        hq = hkv * int(rng.choice([1, 2]))
        block_q, block_kv = (int(x) for x in rng.choice([16, 32], 2))
        nq, nk = (int(x) for x in rng.integers(1, 120, 2))
        dtype = [F32, BF16][seed % 2]
        q, k, v = qkv(rng, 1, nq, nk, hq, hkv, 64, dtype)
        n_kb = -(-nk // block_kv)
        idx, cnt = index_lists(rng, (1, hq, -(-nq // block_q)), n_kb, int(rng.integers(1, n_kb + 1)))
        out, ref = self.both(pk.block_sparse_attention, pk.block_sparse_attention_reference, q, k, v, idx, cnt,
                             block_q=block_q, block_kv=block_kv, preload_indices=bool(seed % 2))
        assert_attention_close(out, ref, dtype)

    # ---- column-sparse ----
    @pytest.mark.parametrize("dtype", [F32, BF16])
    @pytest.mark.parametrize("per_kv_head", [False, True])
    @pytest.mark.parametrize("group_size,nq,nk,width", [(32, 70, 100, 40), (16, 16, 50, 50), (64, 10, 300, 100)])
    def test_column_sparse(self, rng, dtype, per_kv_head, group_size, nq, nk, width):
        prefetch = per_kv_head and dtype == BF16
        b, hq, hkv, d = 2, 4, 2, 64
        q, k, v = qkv(rng, b, nq, nk, hq, hkv, d, dtype)
        idx, cnt = index_lists(rng, (b, hkv if per_kv_head else hq, -(-nq // group_size)), nk, width)
        out, ref = self.both(pk.column_sparse_attention, pk.column_sparse_attention_reference, q, k, v, idx, cnt,
                             group_size=group_size, block_cols=16, prefetch_indices=prefetch)
        assert_attention_close(out, ref, dtype)

    @pytest.mark.parametrize("seed", range(3))
    def test_column_sparse_random_patterns(self, seed):
        rng = np.random.default_rng(2000 + seed)
        hkv = int(rng.choice([1, 2]))
        hq = hkv * int(rng.choice([1, 2]))
        group_size = int(rng.choice([16, 32]))
        nq, nk = (int(x) for x in rng.integers(1, 150, 2))
        dtype = [F32, BF16][seed % 2]
        q, k, v = qkv(rng, 1, nq, nk, hq, hkv, 128, dtype)
        idx, cnt = index_lists(rng, (1, hq, -(-nq // group_size)), nk, int(rng.integers(1, nk + 1)))
        out, ref = self.both(pk.column_sparse_attention, pk.column_sparse_attention_reference, q, k, v, idx, cnt,
                             group_size=group_size, prefetch_indices=bool(seed % 2))
        assert_attention_close(out, ref, dtype)

    # ---- split-KV ----
    @pytest.mark.parametrize("dtype", [F32, BF16])
    @pytest.mark.parametrize("nq,hq,hkv,nk,kv_len,splits", [
        (4, 4, 2, 300, [0, 217], 3),     # an empty cache row, a length inside a tile
        (32, 4, 1, 200, None, 8),        # more splits than live tiles on the short row
        (5, 2, 2, 64, [64, 1], None),    # the default split count
        (4, 4, 2, 300, [300, 290], 3),   # a full cache whose last tile runs past a capacity of 9.4 tiles
        (4, 2, 1, 20, [20, 7], 2),       # a capacity below one tile (padded to one)
        # a fill length per query: two segments of a block (the second sees 4 keys more), an empty first
        # segment; lengths scattered over tiles and splits, a query that sees no key
        (8, 4, 2, 300, [[217] * 4 + [221] * 4, [0] * 4 + [4] * 4], 3),
        (5, 2, 1, 200, [[10, 200, 37, 129, 128], [0, 0, 1, 64, 65]], 4),
    ])
    def test_split_kv(self, rng, dtype, nq, hq, hkv, nk, kv_len, splits):
        q, k, v = qkv(rng, 2, nq, nk, hq, hkv, 64, dtype)
        lengths = None if kv_len is None else jnp.asarray(kv_len)
        out, ref = self.both(pk.split_kv_attention, pk.split_kv_attention_reference, q, k, v, kv_len=lengths,
                             block_kv=32, num_splits=splits)
        assert_attention_close(out, ref, dtype)

    @pytest.mark.parametrize("dtype", [F32, BF16])
    @pytest.mark.parametrize("nq,nk,kv_len,splits", [
        (4, 300, [0, 217], 3),                           # an empty row, a length inside a tile
        (8, 20, [[20] * 4 + [16] * 4, [7] * 8], 2),      # a capacity below one tile; a fill length per query
    ])
    def test_split_kv_reads_a_float8_cache(self, rng, dtype, nq, nk, kv_len, splits):
        """k / v float8 with a scale per position and KV head, dequantized in the kernel: the reference's result
        (which dequantizes first); scratch past the fill lengths holds NaN and Inf scales."""
        q, k, v = qkv(rng, 2, nq, nk, 4, 2, 64, dtype)
        (k8, ks), (v8, vs) = (kv_rows.quantize_rows(x) for x in (k, v))
        ks, vs = (x.at[:, nk - 2:].set(jnp.nan).at[:, nk - 1:].set(jnp.inf) for x in (ks, vs))
        lengths = jnp.minimum(jnp.asarray(kv_len), nk - 2)
        out, ref = self.both(pk.split_kv_attention, pk.split_kv_attention_reference, q, k8, v8, kv_len=lengths,
                             k_scale=ks, v_scale=vs, block_kv=32, num_splits=splits)
        assert_attention_close(out, ref, dtype)

    @pytest.mark.parametrize("dtype", [F32, BF16])
    @pytest.mark.parametrize("b,hkv,splits,g,nq,d", [
        (2, 2, 3, 2, 4, 64),     # query rows padded to 16: the padding is not read
        (1, 8, 33, 4, 4, 128),   # SDAR-8B at batch 1 and 128k: 33 splits
        (2, 2, 1, 4, 8, 64),     # one split
        (1, 2, 5, 1, 1, 64),     # one query, no GQA
    ])
    def test_split_kv_combine(self, rng, dtype, b, hkv, splits, g, nq, d):
        """The partials' merge by LSE, written in the queries' layout: the reference's, with empty partials (lse
        -inf, their o never written: NaN here), an empty row, an invalid partial (+inf) giving NaN, and the
        splits allocated past the count (whole chunks) holding garbage that must not weigh."""
        rows = max(16, 1 << (g * nq - 1).bit_length())
        allocated = split_kv.padded_splits(splits, d)
        o = rng.standard_normal((b, hkv, allocated, rows, d)).astype(np.float32)
        lse = (rng.standard_normal((b, hkv, allocated, rows)) * 3).astype(np.float32)
        lse[rng.random(lse.shape) < 0.3] = -np.inf
        o[np.isneginf(lse)] = np.nan
        lse[0, 0, :, 0] = -np.inf
        lse[-1, -1, splits - 1, g * nq - 1] = np.inf
        o[:, :, splits:], lse[:, :, splits:] = np.nan, np.inf  # never written by a split
        o, lse = jnp.asarray(o), jnp.asarray(lse)
        shape = (b, nq, g * hkv, d)
        out, out_lse = pk.split_kv_combine(o, lse, shape, dtype, num_splits=splits, interpret=self.INTERPRET)
        ref, ref_lse = pk.split_kv_combine_reference(o, lse, shape, dtype, num_splits=splits)
        assert out.dtype == dtype and out.shape == shape and out_lse.shape == (b, g * hkv, nq)
        assert np.isnan(np.asarray(ref_lse)).sum() == 1 and np.isneginf(np.asarray(ref_lse)).sum() >= 1
        tol = 1e-5 if dtype == F32 else 1e-2
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol)
        np.testing.assert_allclose(np.asarray(out_lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("nq,hq,hkv,nk,kv_len,splits", LOGITS_CASES)
    def test_split_kv_logits_give_the_eq3_scores(self, rng, nq, hq, hkv, nk, kv_len, splits):
        """The pass's logits (every column below kv_len written: interpret-mode outputs start as NaN) equal the
        reference's, and with the LSE they give MAGE's scores without reading the keys again."""
        q, k, v = qkv(rng, 2, nq, nk, hq, hkv, 64, F32)
        lengths = None if kv_len is None else jnp.asarray(kv_len)
        kwargs = dict(kv_len=lengths, return_lse=True, return_logits=True, block_kv=32, num_splits=splits)
        o, lse, logits = pk.split_kv_attention(q, k, v, interpret=self.INTERPRET, **kwargs)
        o_ref, lse_ref, logits_ref = pk.split_kv_attention_reference(q, k, v, **kwargs)
        assert_attention_close((o, lse), (o_ref, lse_ref), F32)
        got, want = np.asarray(logits), np.asarray(logits_ref)
        assert got.shape == want.shape == (2, hkv, hq // hkv * nq, nk) and got.dtype == np.float32
        filled = np.arange(nk) < (np.full(2, nk) if kv_len is None else np.asarray(kv_len))[:, None]
        below = np.broadcast_to(filled[:, None, None, :], got.shape)
        np.testing.assert_allclose(got[below], want[below], rtol=1e-5, atol=1e-5)
        scores = pk.kv_scores_from_logits(logits, lse, kv_len=lengths, interpret=self.INTERPRET)
        assert_scores_close(scores, pk.kv_scores_reference(q, k, lse_ref, kv_len=lengths))

    @pytest.mark.parametrize("nq,hq,hkv,nk,kv_len,splits", LOGITS_CASES)
    def test_split_kv_probs_give_the_eq3_scores_to_float16_rounding(self, rng, nq, hq, hkv, nk, kv_len, splits):
        """The pass's float16 form of its logits (probabilities relative to each key tile's maximum, and the
        maxima) equals the reference's below kv_len, every column there written (a last tile loaded from below its
        start writes only its own columns: the ones below belong to the tile before, normalised by its maximum),
        and with the LSE it gives MAGE's scores to float16's rounding."""
        q, k, v = qkv(rng, 2, nq, nk, hq, hkv, 64, F32)
        lengths = None if kv_len is None else jnp.asarray(kv_len)
        kwargs = dict(kv_len=lengths, return_lse=True, return_probs=True, block_kv=32, num_splits=splits)
        o, lse, probs, tile_max = pk.split_kv_attention(q, k, v, interpret=self.INTERPRET, **kwargs)
        o_ref, lse_ref, probs_ref, tile_max_ref = pk.split_kv_attention_reference(q, k, v, **kwargs)
        assert_attention_close((o, lse), (o_ref, lse_ref), F32)
        rows, tiles = hq // hkv * nq, -(-nk // 32)
        assert probs.shape == (2, hkv, rows, nk) and probs.dtype == jnp.float16
        assert tile_max.shape == (2, hkv, rows, tiles) and tile_max.dtype == jnp.float32
        filled = np.full(2, nk) if kv_len is None else np.asarray(kv_len)
        below = np.broadcast_to((np.arange(nk) < filled[:, None])[:, None, None, :], probs.shape)
        got, want = np.asarray(probs, np.float32), np.asarray(probs_ref, np.float32)
        np.testing.assert_allclose(got[below], want[below], rtol=2e-3, atol=0)
        used = np.broadcast_to((np.arange(tiles) * 32 < filled[:, None])[:, None, None, :], tile_max.shape)
        np.testing.assert_allclose(np.asarray(tile_max)[used], np.asarray(tile_max_ref)[used], rtol=1e-5, atol=1e-5)
        scores = pk.kv_scores_from_probs(probs, tile_max, lse, kv_len=lengths, block_kv=32, interpret=self.INTERPRET)
        want = pk.kv_scores_reference(q, k, lse_ref, kv_len=lengths)
        assert np.isfinite(np.asarray(scores)).all()
        np.testing.assert_allclose(scores, want, rtol=2e-3, atol=1e-9)
        np.testing.assert_allclose(pk.kv_scores_from_probs_reference(probs, tile_max, lse, kv_len=lengths, block_kv=32),
                                   scores, rtol=1e-5, atol=1e-9)

    @pytest.mark.parametrize("b,hkv,rows,nk,kv_len", [
        (2, 2, 16, 300, [0, 217]),     # an empty row; a last span overlapping its neighbour (300 = 256 + 44)
        (1, 3, 20, 2500, [2333]),      # 20 rows (not a power of two), spans of 1024 with a partial last one
        (2, 1, 12, 20, None),          # fewer keys than a span of 16: two overlapping spans
    ])
    def test_kv_scores_from_logits(self, rng, b, hkv, rows, nk, kv_len):
        """The Pallas reduction equals the jnp one; NaN logits past kv_len (the pass leaves them unwritten) score 0,
        and every key gets its score (interpret-mode outputs start as NaN)."""
        lengths = np.full(b, nk) if kv_len is None else np.asarray(kv_len)
        logits = rng.standard_normal((b, hkv, rows, nk)).astype(np.float32) * 4
        logits = np.where(np.arange(nk) < lengths[:, None, None, None], logits, np.nan)
        with np.errstate(divide="ignore"):  # the rows' own LSE: -inf where they have no keys
            lse = np.log(np.exp(np.nan_to_num(logits, nan=-np.inf)).sum(-1))
        lse = lse.reshape(b, hkv * 2, rows // 2)
        got = pk.kv_scores_from_logits(jnp.asarray(logits), jnp.asarray(lse), kv_len=None if kv_len is None else
                                       jnp.asarray(lengths), interpret=self.INTERPRET)
        want = pk.kv_scores_from_logits_reference(jnp.asarray(logits), jnp.asarray(lse), kv_len=jnp.asarray(lengths))
        assert got.shape == (b, hkv, nk) and np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
        past = np.broadcast_to(np.arange(nk)[None, None, :] >= lengths[:, None, None], got.shape)
        assert (np.asarray(got)[past] == 0).all()

    @pytest.mark.parametrize("dtype", [F32, BF16])
    @pytest.mark.parametrize("nq,width,splits", [(4, 70, 2), (16, 200, 5), (3, 16, 1)])
    def test_split_kv_gather(self, rng, dtype, nq, width, splits):
        b, hq, hkv, nk = 2, 8, 2, 260
        q, k, v = qkv(rng, b, nq, nk, hq, hkv, 128, dtype)
        idx, cnt = index_lists(rng, (b, hkv), nk, width)
        out, ref = self.both(pk.split_kv_gather_attention, pk.split_kv_gather_attention_reference, q, k, v, idx,
                             cnt, block_kv=16, num_splits=splits)
        assert_attention_close(out, ref, dtype)

    # ---- merge ----
    def test_merge_equals_attention_over_the_union(self, rng):
        q, k, v = qkv(rng, 2, 20, 90, 4, 2, 64, F32)
        lengths = jnp.asarray([90, 50])
        full = pk.flash_attention_reference(q, k, v, kv_len=lengths, return_lse=True)
        first = pk.flash_attention(q, k[:, :40], v[:, :40], kv_len=jnp.minimum(lengths, 40), return_lse=True,
                                   interpret=self.INTERPRET)
        second = pk.flash_attention(q, k[:, 40:], v[:, 40:], kv_len=lengths - 40, return_lse=True,
                                    interpret=self.INTERPRET)
        assert_attention_close(pk.merge_attention(*first, *second), full, F32)
        assert_attention_close(pk.merge_attention(*first, *second), pk.merge_attention_reference(*first, *second),
                               F32)

    def test_merge_with_empty_sides(self, rng):
        o1 = jnp.asarray(rng.standard_normal((1, 3, 2, 16)), F32)
        lse1 = jnp.asarray([[[0.5, -jnp.inf, 2.0], [-jnp.inf, -jnp.inf, 1.0]]], F32)
        lse2 = jnp.asarray([[[-jnp.inf, -jnp.inf, 1.0], [0.0, -jnp.inf, -jnp.inf]]], F32)
        o2 = jnp.asarray(rng.standard_normal((1, 3, 2, 16)), F32)
        o, lse = pk.merge_attention(o1, lse1, o2, lse2)
        np.testing.assert_allclose(o[0, 0, 0], o1[0, 0, 0])          # only side 1 has keys
        np.testing.assert_allclose(o[0, 0, 1], o2[0, 0, 1])          # only side 2
        np.testing.assert_array_equal(o[0, 1], 0.0)                   # neither
        assert np.isneginf(lse[0, :, 1]).all()
        assert_attention_close((o, lse), pk.merge_attention_reference(o1, lse1, o2, lse2), F32)

    # ---- pattern scores ----
    @pytest.mark.parametrize("dtype", [F32, BF16])
    @pytest.mark.parametrize("block_q,block_kv,nq,nk", [(32, 32, 70, 100), (16, 64, 16, 200)])
    def test_block_scores(self, rng, dtype, block_q, block_kv, nq, nk):
        q, k, _ = qkv(rng, 2, nq, nk, 4, 2, 64, dtype)
        lengths = jnp.asarray([0, nk - 5])
        _, lse = pk.flash_attention_reference(q, k, k, kv_len=lengths, return_lse=True)
        out = pk.block_scores(q, k, lse, block_q=block_q, block_kv=block_kv, kv_len=lengths, interpret=self.INTERPRET)
        ref = pk.block_scores_reference(q, k, lse, block_q=block_q, block_kv=block_kv, kv_len=lengths)
        assert_scores_close(out, ref)
        # Each query's probabilities sum to one, so a full block row sums to block_q / (block_q * block_kv).
        np.testing.assert_allclose(np.asarray(out)[1, :, 0].sum(-1), 1.0 / block_kv, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(out)[0], 0.0)

    @pytest.mark.parametrize("dtype", [F32, BF16])
    @pytest.mark.parametrize("group_size,nq,nk", [(32, 70, 100), (16, 20, 64)])
    def test_column_scores(self, rng, dtype, group_size, nq, nk):
        q, k, _ = qkv(rng, 2, nq, nk, 4, 1, 128, dtype)
        lengths = jnp.asarray([nk, 9])
        _, lse = pk.flash_attention_reference(q, k, k, kv_len=lengths, return_lse=True)
        out = pk.column_scores(q, k, lse, group_size=group_size, kv_len=lengths, block_kv=16, interpret=self.INTERPRET)
        ref = pk.column_scores_reference(q, k, lse, group_size=group_size, kv_len=lengths)
        assert_scores_close(out, ref)
        np.testing.assert_allclose(np.asarray(out).sum(-1), 1.0, rtol=1e-5)  # partial last group too
        np.testing.assert_array_equal(np.asarray(out)[1, ..., 9:], 0.0)

    @pytest.mark.parametrize("dtype", [F32, BF16])
    # tiles: key tiles per program (1100 keys in 3-tile programs: a partial last program holding a partial tile)
    @pytest.mark.parametrize("nq,hq,hkv,nk,tiles", [(4, 8, 2, 300, 8), (32, 4, 4, 100, 1), (1, 2, 1, 1100, 3),
                                                    (4, 4, 2, 20, 2)])
    def test_kv_scores(self, rng, dtype, nq, hq, hkv, nk, tiles):
        q, k, _ = qkv(rng, 2, nq, nk, hq, hkv, 64, dtype)
        lengths = jnp.asarray([nk - 3, 0])
        _, lse = pk.split_kv_attention_reference(q, k, k, kv_len=lengths, return_lse=True)
        out = pk.kv_scores(q, k, lse, kv_len=lengths, block_kv=32, tiles_per_program=tiles,
                           interpret=self.INTERPRET)
        ref = pk.kv_scores_reference(q, k, lse, kv_len=lengths)
        assert_scores_close(out, ref)
        np.testing.assert_allclose(np.asarray(out)[0].sum(-1), 1.0, rtol=1e-5)
        np.testing.assert_array_equal(np.asarray(out)[1], 0.0)

    # ---- inside jit: traced index arrays take the clamped path ----
    def test_traced_indices_under_jit(self, rng):
        q, k, v = qkv(rng, 1, 64, 64, 2, 2, 64, F32)
        idx, cnt = index_lists(rng, (1, 2, 2), 2, 2)
        run = jax.jit(functools.partial(pk.block_sparse_attention, block_q=32, block_kv=32, return_lse=True,
                                        interpret=self.INTERPRET))
        ref = pk.block_sparse_attention_reference(q, k, v, idx, cnt, block_q=32, block_kv=32, return_lse=True)
        assert_attention_close(run(q, k, v, idx, cnt), ref, F32)

    def test_traced_gather_lists_are_clamped_in_the_kernel(self, rng):
        """Traced lists reach the gathered kernel as they are (no clamping op before it, MAGE's sparse steps launch
        the kernel alone): it clamps live indices into the cache and counts to the width, as the reference does."""
        q, k, v = qkv(rng, 2, 4, 96, 8, 2, 64, F32)
        # distinct positions 1..94 (the reference's mask counts a repeat once), two live ones out of range, which
        # clamp to positions (0 and 95) not listed
        idx = jnp.asarray([[rng.permutation(94)[:40] + 1 for _ in range(2)] for _ in range(2)], jnp.int32)
        idx = idx.at[0, 0, 3].set(200).at[1, 1, 0].set(-5)
        cnt = jnp.asarray([[45, 7], [0, 40]], jnp.int32)  # a count past the width, an empty list
        got, ref, clamped = (
            jax.jit(functools.partial(f, return_lse=True, block_kv=16, **kw))(q, k, v, *lists)
            for f, kw, lists in ((pk.split_kv_gather_attention, {"interpret": self.INTERPRET}, (idx, cnt)),
                                 (pk.split_kv_gather_attention_reference, {}, (idx, cnt)),
                                 (pk.split_kv_gather_attention_reference, {},
                                  (jnp.clip(idx, 0, 95), jnp.minimum(cnt, 40)))))
        assert_attention_close(got, ref, F32)
        assert_attention_close(ref, clamped, F32)

    # ---- grouped matmul (MoE experts) ----
    @pytest.mark.parametrize("dtype", [F32, BF16])
    @pytest.mark.parametrize("groups,k,n,block_m,tile_groups", [
        (4, 64, 48, 16, [0, 0, 1, 3, 3, 3, 4, 4]),   # group 2 owns no tile, two unused tiles, N not a block
        (3, 40, 128, 32, [1, 2]),                     # K not a block, group 0 empty, every tile used
        (8, 128, 256, 16, [5, 8, 8, 8]),              # one used tile
    ])
    def test_grouped_matmul(self, rng, dtype, groups, k, n, block_m, tile_groups):
        tiles = jnp.asarray(tile_groups, jnp.int32)
        x = jnp.asarray(rng.standard_normal((len(tile_groups) * block_m, k)), dtype)
        w = jnp.asarray(rng.standard_normal((groups, k, n)) / np.sqrt(k), dtype)
        out = np.asarray(pk.grouped_matmul(x, w, tiles, block_m=block_m, block_k=32, block_n=64,
                                           interpret=self.INTERPRET), np.float32)
        ref = np.asarray(pk.grouped_matmul_reference(x, w, tiles, block_m=block_m), np.float32)
        # the definition, tile by tile, in float64
        want = np.zeros_like(ref)
        for t, g in enumerate(tile_groups):
            if g < groups:
                rows = slice(t * block_m, (t + 1) * block_m)
                want[rows] = np.asarray(x[rows], np.float64) @ np.asarray(w[g], np.float64)
        for got in (out, ref):
            assert got.shape == want.shape and np.isfinite(got).all()
            assert np.abs(got - want).max() / np.abs(want).max() <= O_TOL[dtype]

    @pytest.mark.parametrize("wdtype", [jnp.int8, jnp.float8_e4m3fn])
    def test_grouped_matmul_of_quantized_weights(self, rng, wdtype):
        """w [G, N, K] in one byte with a scale [G, N] (LLaDA2's quantized routed experts): each tile's product
        scaled by its group's scale; group 1 owns no tile, the last tile is unused, N is not a block."""
        groups, k, n, block_m, tile_groups = 3, 64, 48, 16, [0, 0, 2, 3]
        tiles = jnp.asarray(tile_groups, jnp.int32)
        x = jnp.asarray(rng.standard_normal((len(tile_groups) * block_m, k)), BF16)
        if wdtype == jnp.int8:
            w = jnp.asarray(rng.integers(-127, 128, (groups, n, k)), jnp.int8)
        else:
            w = jnp.asarray(rng.standard_normal((groups, n, k)) * 40, wdtype)
        scale = jnp.asarray(rng.uniform(1e-3, 1e-2, (groups, n)), F32)
        out = np.asarray(pk.grouped_matmul(x, w, tiles, block_m=block_m, block_k=32, block_n=32, w_scale=scale,
                                           interpret=self.INTERPRET), np.float32)
        ref = np.asarray(pk.grouped_matmul_reference(x, w, tiles, block_m=block_m, w_scale=scale), np.float32)
        want = np.zeros_like(ref)
        for t, g in enumerate(tile_groups):
            if g < groups:
                rows = slice(t * block_m, (t + 1) * block_m)
                dequantized = np.asarray(w[g].astype(F32), np.float64) * np.asarray(scale[g], np.float64)[:, None]
                want[rows] = np.asarray(x[rows], np.float64) @ dequantized.T
        for got in (out, ref):
            assert got.shape == want.shape and np.isfinite(got).all()
            assert np.abs(got - want).max() / np.abs(want).max() <= O_TOL[BF16]
        np.testing.assert_array_equal(out[3 * block_m:], 0.0)

    # ---- quantized matmul (decode's GEMM of int8 / FP8 weights) ----
    @pytest.mark.parametrize("wdtype", [jnp.int8, jnp.float8_e4m3fn])
    @pytest.mark.parametrize("m,n,k,block_n,block_k,split_k", [
        (4, 64, 256, 16, 64, 1),     # decode's 4 rows, the scale applied in the kernel
        (1, 96, 512, 32, 128, 2),    # one row; K in two parts summed outside
        (16, 48, 128, 16, 32, 4),    # a whole row tile, four K parts of one step each
    ])
    def test_quantized_matmul(self, rng, wdtype, m, n, k, block_n, block_k, split_k):
        x = jnp.asarray(rng.standard_normal((m, k)), BF16)
        if wdtype == jnp.int8:
            w = jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8)
        else:
            w = jnp.asarray(rng.standard_normal((n, k)) * 40, wdtype)
        scale = jnp.asarray(rng.uniform(1e-3, 1e-2, n), F32)
        scale = scale.at[0].set(0.0)  # a zero channel
        out = pk.quantized_matmul(x, w, scale, block_n=block_n, block_k=block_k, split_k=split_k,
                                  interpret=self.INTERPRET)
        ref = pk.quantized_matmul_reference(x, w, scale)
        want = (np.asarray(x, np.float64) @ np.asarray(w.astype(F32), np.float64).T) * np.asarray(scale, np.float64)
        for got in (out, ref):
            got = np.asarray(got, np.float32)
            assert got.dtype == np.float32 and got.shape == (m, n) and np.isfinite(got).all()
            assert np.abs(got - want).max() / np.abs(want).max() <= O_TOL[BF16]
        assert out.dtype == BF16
        np.testing.assert_array_equal(np.asarray(out, np.float32)[:, 0], 0.0)


class TestKernelsInterpret(KernelChecks):
    INTERPRET = True

    def test_interpret_outputs_start_poisoned(self):
        def writes_half(x_ref, o_ref):
            o_ref[pl.ds(0, 8)] = x_ref[pl.ds(0, 8)]

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = pl.pallas_call(writes_half, out_shape=jax.ShapeDtypeStruct((16,), F32), interpret=True)(
                jnp.ones(16, F32))
        assert np.isnan(np.asarray(out)[8:]).all()


@pytest.mark.gpu
class TestKernelsGPU(KernelChecks):
    INTERPRET = False

    def test_long_bf16_shapes(self, rng):
        q, k, v = qkv(rng, 1, 1000, 1500, 8, 2, 128, BF16)
        idx, cnt = index_lists(rng, (1, 8, 8), 12, 6)
        out, ref = self.both(pk.block_sparse_attention, pk.block_sparse_attention_reference, q, k, v, idx, cnt,
                             block_q=128, block_kv=128)
        assert_attention_close(out, ref, BF16)
        self.check_column_sparse_and_split_kv(rng, q, k, v, 1234, BF16)

    def test_float32_head_dim_128_default_tiles(self, rng):
        """fp32 at head_dim 128 with each kernel's default tiles: 3 pipeline stages of 128-row K/V tiles would
        ask 384 KiB of shared memory (RESOURCE_EXHAUSTED at launch); the defaults fit it."""
        q, k, v = qkv(rng, 1, 200, 600, 4, 2, 128, F32)
        out, ref = self.both(pk.flash_attention, pk.flash_attention_reference, q, k, v)
        assert_attention_close(out, ref, F32)
        self.check_column_sparse_and_split_kv(rng, q, k, v, 555, F32)

    def check_column_sparse_and_split_kv(self, rng, q, k, v, kv_len: int, dtype):
        """The column-sparse kernel (64-query groups, up to 300 columns each) and the split-KV kernel (the
        first 32 queries over kv_len keys) against their references on q, k, v [1, L, H, D]."""
        _, n, heads, _ = q.shape
        cols, counts = index_lists(rng, (1, heads, n // 64 + 1), k.shape[1], 300)
        out, ref = self.both(pk.column_sparse_attention, pk.column_sparse_attention_reference, q, k, v, cols,
                             counts, group_size=64)
        assert_attention_close(out, ref, dtype)
        out, ref = self.both(pk.split_kv_attention, pk.split_kv_attention_reference, q[:, :32], k, v,
                             kv_len=jnp.asarray([kv_len]))
        assert_attention_close(out, ref, dtype)


# ---- bad input: a ValueError naming the problem, checked on the host before any kernel runs ----
def _bad_calls():
    q, k, v = (jnp.zeros(s, BF16) for s in [(1, 64, 4, 64), (1, 64, 2, 64), (1, 64, 2, 64)])
    idx, cnt = jnp.zeros((1, 4, 2, 2), jnp.int32), jnp.ones((1, 4, 2), jnp.int32)
    lse = jnp.zeros((1, 4, 64), F32)
    bs = functools.partial(pk.block_sparse_attention, block_q=32, block_kv=32)
    cs = functools.partial(pk.column_sparse_attention, group_size=32)
    gm, gx, gw = pk.grouped_matmul, q[0, :, 0], q[0, :, :2].reshape(2, 64, 64)  # x [64, 64], w [2, 64, 64]
    qm, qx, qw, qs = pk.quantized_matmul, q[0, :4, 0], jnp.zeros((32, 64), jnp.int8), jnp.ones(32, F32)
    return {
        "rank": (lambda: pk.flash_attention(q[0], k, v), "must be [batch, seq, heads, head_dim]"),
        "dtype": (lambda: pk.flash_attention(q.astype(jnp.int8), k, v), "not supported"),
        "mixed dtypes": (lambda: pk.flash_attention(q.astype(F32), k, v), "share a dtype"),
        "head_dim": (lambda: pk.flash_attention(*(x[..., :48] for x in (q, k, v))), "head_dim=48"),
        "gqa": (lambda: pk.flash_attention(q[:, :, :3], k, v), "multiple of key/value heads"),
        "kv_len range": (lambda: pk.flash_attention(q, k, v, kv_len=65), "out of range"),
        "kv_len shape": (lambda: pk.flash_attention(q, k, v, kv_len=jnp.asarray([3, 4])), "kv_len must be"),
        "block size": (lambda: pk.flash_attention(q, k, v, block_q=48), "block_q=48"),
        "negative index": (lambda: bs(q, k, v, idx.at[0, 0, 0, 0].set(-1), cnt), "out of range"),
        "index too large": (lambda: bs(q, k, v, idx.at[0, 1, 1, 0].set(2), cnt), "index 2"),
        "count too large": (lambda: bs(q, k, v, idx, cnt.at[0, 0, 0].set(3)), "counts must lie in"),
        "negative count": (lambda: bs(q, k, v, idx, cnt.at[0, 0, 0].set(-1)), "counts must lie in"),
        "duplicate": (lambda: bs(q, k, v, idx, cnt.at[0, 0, 0].set(2)), "repeat"),
        "index heads": (lambda: bs(q, k, v, idx[:, :3], cnt[:, :3]), "indices have shape"),
        "index rows": (lambda: bs(q, k, v, idx[:, :, :1], cnt[:, :, :1]), "indices have shape"),
        "count shape": (lambda: bs(q, k, v, idx, cnt[:, :2]), "counts have shape"),
        "float indices": (lambda: bs(q, k, v, idx.astype(F32), cnt), "must be integers"),
        "column range": (lambda: cs(q, k, v, idx.at[0, 0, 0, 0].set(64), cnt), "out of range [0, 64)"),
        "group size": (lambda: pk.column_sparse_attention(q, k, v, idx, cnt, group_size=24), "group_size=24"),
        "split-KV rows": (lambda: pk.split_kv_attention(jnp.zeros((1, 200, 4, 64), BF16), k, v), "at most 256"),
        "split-KV query lengths": (lambda: pk.split_kv_attention(q, k, v, kv_len=jnp.ones((1, 3), jnp.int32)),
                                   "[1, 64] (one per query)"),
        "split-KV query lengths stored": (lambda: pk.split_kv_attention(q, k, v, kv_len=jnp.ones((1, 64), jnp.int32),
                                                                        return_logits=True), "one fill length per row"),
        "split-KV query length range": (lambda: pk.split_kv_attention(q, k, v, kv_len=jnp.full((1, 64), 65)),
                                        "out of range"),
        "gather heads": (lambda: pk.split_kv_gather_attention(q[:, :4], k, v, idx[:, :, 0], cnt[:, :, 0]),
                         "one list per KV head"),
        "lse dtype": (lambda: pk.block_scores(q, k, lse.astype(BF16), block_q=32, block_kv=32), "lse must be float32"),
        "lse shape": (lambda: pk.column_scores(q, k, lse[:, :2], group_size=32), "lse must be"),
        "merge shapes": (lambda: pk.merge_attention(q, lse, q[:, :10], lse), "same shape"),
        "merge bf16 lse": (lambda: pk.merge_attention(q, lse.astype(BF16), q, lse), "float32"),
        "grouped rows": (lambda: gm(gx, gw, jnp.zeros(2, jnp.int32), block_m=48), "block_m=48"),
        "grouped order": (lambda: gm(gx, gw, jnp.asarray([1, 0, 2, 2]), block_m=16), "nondecreasing"),
        "grouped tiles": (lambda: gm(gx, gw, jnp.zeros(3, jnp.int32), block_m=16), "one per tile"),
        "grouped shapes": (lambda: gm(gx, gw[:, :32], jnp.zeros(4, jnp.int32), block_m=16), "w [G, K, N]"),
        "grouped quantized": (lambda: gm(gx, qw[None], jnp.zeros(4, jnp.int32), block_m=16, w_scale=qs[None, :8]),
                              "w [G, N, K] and scale [G, N]"),
        "grouped quantized dtype": (lambda: gm(gx, gw, jnp.zeros(4, jnp.int32), block_m=16,
                                                   w_scale=jnp.ones((2, 64))),
                                    "int8 or float8_e4m3fn"),
        "quantized rows": (lambda: qm(jnp.zeros((17, 64), BF16), qw, qs, block_k=32), "1..16 rows"),
        "quantized K": (lambda: qm(qx, qw, qs, block_k=32, split_k=4), "split_k * block_k = 128"),
        "quantized N": (lambda: qm(qx, qw, qs, block_n=64, block_k=32), "block_n=64"),
        "quantized weight": (lambda: qm(qx, qw.astype(BF16), qs, block_k=32), "w.dtype=bfloat16"),
        "quantized x": (lambda: qm(qx.astype(F32), qw, qs, block_k=32), "x.dtype=float32"),
        "quantized scale": (lambda: qm(qx, qw, qs[:8], block_k=32), "scale [N]"),
        "quantized split": (lambda: qm(qx, qw, qs, block_k=32, split_k=0), "split_k=0"),
        "merge +inf lse": (lambda: pk.merge_attention(q, lse.at[0, 1, 2].set(jnp.inf), q, lse), "lse1[0, 1, 2] = inf"),
        "combine whole chunks": (lambda: pk.split_kv_combine(jnp.zeros((1, 2, 3, 16, 64)), jnp.zeros((1, 2, 3, 16)),
                                                             (1, 4, 4, 64), F32), "padded_splits(3, 64) = 4"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_raises_value_error(case):
    call, message = _bad_calls()[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_split_kv_fill_length_per_query_is_each_query_attended_alone(rng):
    """The reference's [B, Nq] fill lengths mean what they say: each query's output and LSE are those of that
    query alone against the cache filled to its own length (the kernels are checked against this reference)."""
    q, k, v = qkv(rng, 2, 6, 90, 4, 2, 64, jnp.float32)
    lengths = jnp.asarray([[3, 90, 40, 41, 0, 64], [1, 1, 2, 77, 77, 90]], jnp.int32)
    o, lse = pk.split_kv_attention_reference(q, k, v, kv_len=lengths, return_lse=True)
    for i in range(6):
        o_i, lse_i = pk.split_kv_attention_reference(q[:, i:i + 1], k, v, kv_len=lengths[:, i], return_lse=True)
        np.testing.assert_allclose(np.asarray(o[:, i:i + 1]), np.asarray(o_i), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(lse[..., i:i + 1]), np.asarray(lse_i), rtol=1e-6)


@pytest.mark.parametrize("nk", [200, 256])
def test_split_kv_reads_a_cache_of_any_capacity_in_place(rng, nk):
    """A capacity that is not a multiple of the key tile reaches the kernel as it is: no pad (a copy of
    the whole cache per call, at 128k keys 3x the attention's own time) anywhere in the program."""
    q, k, v = qkv(rng, 1, 4, nk, 4, 2, 64, jnp.float32)
    jaxpr = jax.make_jaxpr(functools.partial(pk.split_kv_attention, kv_len=jnp.asarray([nk - 3]), block_kv=64,
                                             interpret=True))(q, k, v)
    equations = list(jaxpr_equations(jaxpr.jaxpr))
    calls = [e for e in equations if e.primitive.name == "pallas_call" and e.params["name"] == "split_kv_attention"]
    assert calls and all(x.aval.shape == k.shape for e in calls for x in e.invars[-2:])
    assert not [e for e in equations if e.primitive.name == "pad" and e.invars[0].aval.shape == k.shape]


def test_kv_scores_from_probs_names_what_does_not_fit():
    probs, tile_max = jnp.zeros((1, 2, 16, 40), jnp.float16), jnp.zeros((1, 2, 16, 2), jnp.float32)
    with pytest.raises(ValueError, match=r"tile_max must be \[B, Hkv, G \* Nq, ceil\(Nk / block_kv\)\] = "
                                         r"\(1, 2, 16, 1\)"):
        pk.kv_scores_from_probs(probs, tile_max, jnp.zeros((1, 4, 8)), block_kv=64)
    with pytest.raises(ValueError, match="probs must be float16"):
        pk.kv_scores_from_probs(probs.astype(jnp.float32), tile_max, jnp.zeros((1, 4, 8)), block_kv=32)
    with pytest.raises(ValueError, match=r"lse must be \[B, Hq, Nq\] with \(Hq / Hkv\) \* Nq = 16 folded rows"):
        pk.kv_scores_from_probs(probs, tile_max, jnp.zeros((1, 4, 3)), block_kv=32)
    with pytest.raises(ValueError, match="two forms of the same thing"):
        pk.split_kv_attention(jnp.zeros((1, 4, 4, 64)), *(jnp.zeros((1, 64, 2, 64)),) * 2, return_logits=True,
                              return_probs=True)


def test_kv_scores_from_logits_names_an_lse_that_does_not_fold_onto_the_logits():
    with pytest.raises(ValueError, match=r"lse must be \[B, Hq, Nq\] with \(Hq / Hkv\) \* Nq = 16 folded rows"):
        pk.kv_scores_from_logits(jnp.zeros((1, 2, 16, 40)), jnp.zeros((1, 4, 3)))
    with pytest.raises(ValueError, match="logits must be float32"):
        pk.kv_scores_from_logits(jnp.zeros((1, 2, 16, 40), jnp.bfloat16), jnp.zeros((1, 4, 8)))


@pytest.mark.parametrize("nk", [200, 256, 131200])
def test_kv_scores_reads_a_cache_of_any_capacity_in_place(rng, nk):
    """MAGE's scores take the cache as the split-KV kernels do: at any capacity (200: not a multiple of the
    kernel's 64-key tiles; generate's 128k capacity, 1025 tiles of 128, was not one of its 512-key programs before
    session 18) the key array reaches the kernel unpadded (a pad copied the
    whole layer cache per call: 6.2 of 56.5 ms of GPU time per output block at batch 1, H100, issue 40)."""
    q = jax.ShapeDtypeStruct((1, 4, 4, 64), jnp.float32)
    k = jax.ShapeDtypeStruct((1, nk, 2, 64), jnp.float32)
    lse = jax.ShapeDtypeStruct((1, 4, 4), jnp.float32)
    jaxpr = jax.make_jaxpr(functools.partial(pk.kv_scores, kv_len=jnp.asarray([nk - 3]), interpret=True))(q, k, lse)
    equations = list(jaxpr_equations(jaxpr.jaxpr))
    calls = [e for e in equations if e.primitive.name == "pallas_call"]
    assert calls and all(e.invars[-1].aval.shape == k.shape for e in calls)
    assert not [e for e in equations if e.primitive.name == "pad" and e.invars[0].aval.shape == k.shape]
