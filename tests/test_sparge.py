"""SpargeAttn: the predicted map against a numpy transcription of the published rule, the PV-skip kernel
against its reference, and the limits (keep-everything thresholds give dense attention; a filter that
never fires gives block-sparse attention with the same map). Interpret mode on CPU, Triton on the GPU."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels as pk
from pallas_kernels.sparge import map_to_lists
from test_kernels import BF16, F32, assert_attention_close

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def numpy_block_map(q, k, *, simthreshd1, cdfthreshd=None, topk=None, smooth_k=True, block_q, block_kv,
                    attention_sink=False):
    """The rule as docs/methods.md §4 states it, one row at a time in float64 with explicit Gram matrices; a
    partial last block is zero-padded to its full size as the official kernels load it, so its zero rows'
    directions are 0/0 and its similarity NaN (never above the threshold)."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    if smooth_k:
        k = k - k.mean(axis=1, keepdims=True)
    nqb, nkb = -(-nq // block_q), -(-nk // block_kv)
    per_head = lambda x: np.broadcast_to(np.asarray(x, np.float64), (hq,))
    theta = per_head(simthreshd1)

    def blocks(x, size, count):
        out = []
        for i in range(count):
            rows = x[i * size:(i + 1) * size]
            padded = np.concatenate([rows, np.zeros((size - len(rows), d))])
            with np.errstate(invalid="ignore"):
                unit = padded / np.linalg.norm(padded, axis=1, keepdims=True)
            similarity = (unit @ unit.T).sum() / len(rows) ** 2  # mean cosine over all pairs of real rows
            out.append((rows.mean(axis=0), similarity))
        return out

    keep = np.zeros((b, hq, nqb, nkb), bool)
    for bi in range(b):
        for h in range(hq):
            qb = blocks(q[bi, :, h], block_q, nqb)
            kb = blocks(k[bi, :, h // (hq // hkv)], block_kv, nkb)
            k_similar = np.array([s > theta[h] for _, s in kb])
            for i, (pooled, sim) in enumerate(qb):
                s = np.array([pooled @ km / np.sqrt(d) for km, _ in kb])
                s[~k_similar] = -np.inf
                if k_similar.any():
                    p = np.exp(s - s.max())
                    p /= p.sum()
                else:
                    p = np.zeros(nkb)
                order = np.argsort(-p, kind="stable")
                if cdfthreshd is not None:
                    num = np.searchsorted(np.cumsum(p[order]), per_head(cdfthreshd)[h], side="right")
                else:
                    num = int(np.floor(per_head(topk)[h] * nkb))
                keep[bi, h, i, order[:max(num, 1)]] = True
                keep[bi, h, i, ~k_similar] = True
                if not sim > theta[h]:
                    keep[bi, h, i] = True
                if attention_sink:
                    keep[bi, h, i, 0] = True
    return keep


def structured_qkv(rng, b, n, hq, hkv, d, dtype, *, block=32):
    """Blocks of nearly equal rows (self-similar) next to blocks of independent rows, with a few
    strongly aligned query/key directions so that some tiles dominate the attention."""
    def make(heads):
        x = rng.standard_normal((b, n, heads, d))
        for start in range(0, n, block):
            if (start // block) % 3 != 2:  # two in three blocks self-similar
                x[:, start:start + block] = 3.0 * rng.standard_normal((b, 1, heads, d)) + 0.3 * x[:, start:start + block]
        return x
    q, k, v = make(hq), make(hkv), rng.standard_normal((b, n, hkv, d))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def skewed_qkv(rng, b, n, hq, hkv, d, dtype, *, hot_keys=8):
    """A few keys near the start align with every query (large logits), the rest are noise: after the
    first tile, later tiles fall far below the running maximum and the PV filter fires."""
    q = rng.standard_normal((b, n, hq, d)) * 0.3
    k = rng.standard_normal((b, n, hkv, d)) * 0.3
    direction = rng.standard_normal(d)
    q += 2.0 * direction
    k[:, :hot_keys] += 2.0 * direction
    v = rng.standard_normal((b, n, hkv, d))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


class SpargeChecks:
    INTERPRET = False

    @pytest.mark.parametrize("rule", [dict(cdfthreshd=0.7), dict(topk=0.4), dict(cdfthreshd=np.array([0.2, 0.5, 0.9, 0.99]))])
    @pytest.mark.parametrize("smooth_k,sink", [(True, False), (False, True)])
    def test_predicted_map_matches_numpy_rule(self, rng, rule, smooth_k, sink):
        b, nq, nk, hq, hkv, d = 2, 150, 230, 4, 2, 32  # partial last blocks on both axes, GQA
        q, _, _ = structured_qkv(rng, b, nq, hq, hkv, d, F32, block=16)
        _, k, _ = structured_qkv(rng, b, nk, hq, hkv, d, F32, block=32)
        sim = np.array([0.3, 0.5, 0.2, 0.6])  # per head: some blocks similar, some not
        args = dict(simthreshd1=sim, smooth_k=smooth_k, block_q=16, block_kv=32, attention_sink=sink, **rule)
        got = np.asarray(pk.predict_block_map(q, k, **args))
        want = numpy_block_map(q, k, **args)
        assert 0 < want.mean() < 1, "the inputs should exercise both kept and pruned blocks"
        np.testing.assert_array_equal(got, want)
        assert want[:, :, -1].all() and want[..., -1].all()  # the partial last blocks: kept whole

    def test_whole_last_blocks_are_judged_by_their_similarity(self, rng):
        """Lengths that are multiples of the blocks: the last blocks are whole and may be pruned like any other
        (only partial ones are always kept)."""
        q, k, _ = structured_qkv(rng, 1, 128, 2, 2, 32, F32)
        keep = np.asarray(pk.predict_block_map(q, k, simthreshd1=-1.0, cdfthreshd=0.0, block_q=16, block_kv=32))
        assert not keep[..., -1].all()
        partial = np.asarray(pk.predict_block_map(q[:, :120], k[:, :120], simthreshd1=-1.0, cdfthreshd=0.0,
                                                  block_q=16, block_kv=32))
        assert partial[..., -1].all() and partial[:, :, -1].all()

    def test_similarity_decides_fix_blocks(self, rng):
        """simthreshd1 above every similarity makes every block a fix block (the map is full); below every
        similarity leaves only the TopCdf choice (at least one block per row)."""
        q, k, _ = structured_qkv(rng, 1, 128, 2, 2, 32, F32)
        full = pk.predict_block_map(q, k, simthreshd1=1.01, cdfthreshd=0.0, block_q=16, block_kv=32)
        assert np.asarray(full).all()
        sparse = np.asarray(pk.predict_block_map(q, k, simthreshd1=-1.0, cdfthreshd=0.0, block_q=16, block_kv=32))
        np.testing.assert_array_equal(sparse.sum(-1), 1)

    @pytest.mark.parametrize("dtype", [F32, BF16])
    @pytest.mark.parametrize("hq,hkv,n", [(4, 2, 200), (2, 2, 128)])
    def test_keep_everything_equals_dense(self, rng, dtype, hq, hkv, n):
        q, k, v = structured_qkv(rng, 2, n, hq, hkv, 64, dtype)
        out = pk.sparge_attention(q, k, v, simthreshd1=0.0, topk=1.0, pvthreshd=None, block_q=32, block_kv=64,
                                  return_lse=True, interpret=self.INTERPRET)
        assert_attention_close(out, pk.flash_attention_reference(q, k, v, return_lse=True), dtype)

    @pytest.mark.parametrize("dtype", [F32, BF16])
    def test_filter_that_never_fires_equals_block_sparse(self, rng, dtype):
        q, k, v = structured_qkv(rng, 2, 300, 4, 2, 64, dtype, block=64)
        prediction = dict(simthreshd1=0.4, cdfthreshd=0.6, block_q=32, block_kv=64)
        o, lse, sparsity = pk.sparge_attention(q, k, v, pvthreshd=1e4, return_lse=True, return_sparsity=True,
                                               interpret=self.INTERPRET, **prediction)
        indices, counts = map_to_lists(pk.predict_block_map(q, k, **prediction))
        same_map = pk.block_sparse_attention_reference(q, k, v, indices, counts, block_q=32, block_kv=64,
                                                       return_lse=True)
        assert_attention_close((o, lse), same_map, dtype)
        np.testing.assert_array_equal(sparsity.pv, sparsity.qk)
        assert 0 < float(sparsity.map_sparsity()) < 1

    @pytest.mark.parametrize("dtype", [F32, BF16])
    @pytest.mark.parametrize("nq,block_q,per_head", [(200, 32, False), (64, 64, True)])
    def test_pv_skip_matches_reference(self, rng, dtype, nq, block_q, per_head):
        b, nk, hq, hkv, d, block_kv = 2, 300, 4, 2, 64, 32
        q, k, v = skewed_qkv(rng, b, max(nq, nk), hq, hkv, d, dtype)
        q = q[:, :nq]
        n_kb = -(-nk // block_kv)
        indices = jnp.broadcast_to(jnp.arange(n_kb, dtype=jnp.int32), (b, hq, -(-nq // block_q), n_kb))
        counts = jnp.full(indices.shape[:3], n_kb, jnp.int32).at[0, 0, 0].set(0).at[1, 1, 0].set(3)
        threshold = np.array([2.0, 4.0, 8.0, 16.0]) if per_head else 6.0
        args = dict(pvthreshd=threshold, block_q=block_q, block_kv=block_kv, kv_len=jnp.asarray([nk, nk - 40]),
                    return_lse=True, return_skipped=True)
        o, lse, skipped = pk.pv_skip_attention(q, k[:, :nk], v[:, :nk], indices, counts, interpret=self.INTERPRET,
                                               **args)
        o_ref, lse_ref, skipped_ref = pk.pv_skip_attention_reference(q, k[:, :nk], v[:, :nk], indices, counts,
                                                                     **args)
        assert_attention_close((o, lse), (o_ref, lse_ref), dtype)
        np.testing.assert_array_equal(skipped, skipped_ref)
        skipped = np.asarray(skipped)
        assert skipped.sum() > 0, "the skewed inputs should make the filter fire"
        assert (skipped <= np.maximum(np.asarray(counts) - 1, 0)).all(), "the first tile is never skipped"
        # the skipped tiles carried little mass: the filtered output stays close to exact attention
        exact = pk.block_sparse_attention_reference(q, k[:, :nk], v[:, :nk], indices, counts, block_q=block_q,
                                                    block_kv=block_kv, kv_len=args["kv_len"])
        o, exact = np.asarray(o, np.float32), np.asarray(exact, np.float32)
        assert np.abs(o - exact).sum() / np.abs(exact).sum() < 0.05

    def test_sparsity_counts(self, rng):
        q, k, v = skewed_qkv(rng, 1, 256, 2, 1, 64, F32)
        o, sparsity = pk.sparge_attention(q, k, v, simthreshd1=-1.0, topk=0.5, pvthreshd=4.0, block_q=32,
                                          block_kv=32, return_sparsity=True, interpret=self.INTERPRET)
        np.testing.assert_array_equal(sparsity.total, 8 * 8)
        np.testing.assert_array_equal(sparsity.qk, 8 * 4)  # floor(0.5 * 8) blocks per row
        assert (np.asarray(sparsity.pv) < np.asarray(sparsity.qk)).all()
        assert float(sparsity.pv_sparsity()) > float(sparsity.map_sparsity()) == 0.5
        assert np.isfinite(np.asarray(o)).all()

    def test_inside_jit(self, rng):
        q, k, v = structured_qkv(rng, 1, 128, 2, 2, 64, BF16)
        args = dict(simthreshd1=0.3, cdfthreshd=0.8, pvthreshd=10.0, block_q=32, block_kv=32)
        run = jax.jit(lambda q, k, v: pk.sparge_attention(q, k, v, interpret=self.INTERPRET, **args))
        assert_attention_close((run(q, k, v), jnp.zeros(())),
                               (pk.sparge_attention_reference(q, k, v, **args), jnp.zeros(())), BF16)


class TestSpargeInterpret(SpargeChecks):
    INTERPRET = True


@pytest.mark.gpu
class TestSpargeGPU(SpargeChecks):
    INTERPRET = False

    def test_long_bf16_default_tiles(self, rng):
        q, k, v = structured_qkv(rng, 1, 2000, 8, 2, 128, BF16, block=64)
        args = dict(simthreshd1=0.3, cdfthreshd=0.9, pvthreshd=12.0, return_lse=True, return_sparsity=True)
        o, lse, sparsity = pk.sparge_attention(q, k, v, **args)
        o_ref, lse_ref, sparsity_ref = pk.sparge_attention_reference(q, k, v, **args)
        assert_attention_close((o, lse), (o_ref, lse_ref), BF16)
        np.testing.assert_array_equal(sparsity.qk, sparsity_ref.qk)


def _bad_calls():
    q, k, v = (jnp.zeros(s, BF16) for s in [(1, 128, 4, 64), (1, 128, 2, 64), (1, 128, 2, 64)])
    sp = lambda **kw: pk.sparge_attention(q, k, v, **{"simthreshd1": 0.3, "pvthreshd": None, **kw})
    idx, cnt = jnp.zeros((1, 4, 4, 2), jnp.int32), jnp.ones((1, 4, 4), jnp.int32)
    return {
        "both rules": (lambda: sp(cdfthreshd=0.9, topk=0.5), "exactly one of cdfthreshd"),
        "no rule": (lambda: sp(), "exactly one of cdfthreshd"),
        "cdf range": (lambda: sp(cdfthreshd=1.5), "cdfthreshd=1.5 must be finite and lie in [0.0, 1.0]"),
        "per-head shape": (lambda: sp(topk=0.5, simthreshd1=np.zeros(3)), "one value per query head [4]"),
        "pv threshold": (lambda: sp(topk=0.5, pvthreshd=np.nan), "pvthreshd=nan must be finite"),
        "block": (lambda: sp(topk=0.5, block_q=48), "block_q=48"),
        "head_dim": (lambda: pk.sparge_attention(q[..., :48], k[..., :48], v[..., :48], simthreshd1=0.0, topk=0.5,
                                                 pvthreshd=None), "head_dim=48"),
        "index range": (lambda: pk.pv_skip_attention(q, k, v, idx.at[0, 0, 0, 0].set(4), cnt, pvthreshd=1.0,
                                                     block_q=32, block_kv=32), "out of range [0, 4)"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_input_raises_value_error(case):
    call, message = _bad_calls()[case]
    with pytest.raises(ValueError, match=re.escape(message)):
        call()
