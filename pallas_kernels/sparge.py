"""SpargeAttn (arXiv 2502.18137; official code thu-ml/SpargeAttn, docs/methods.md §4): a block map
predicted from pooled queries and keys, then block-sparse flash attention with a second-stage filter
that skips exp(S)·V for key tiles whose logits are far below the running maximum.

Stage 1, `predict_block_map` (plain XLA: pooling costs one read of q and k, the scores are tiny):
  1. smooth_k: k <- k - mean over the sequence of k (per batch row and KV head);
  2. per block of block_q query rows / block_kv key rows: the mean row, and the self-similarity
     mean_ij cos(x_i, x_j) = |sum_i x_i/|x_i||^2 / n^2 (diagonal included, n the block's true size);
     a block is "similar" iff its self-similarity > simthreshd1 and it is whole (the official kernels'
     zero padding makes a partial last block's similarity NaN, so it is never similar: computed whole);
  3. S = pooled_q pooled_k^T * scale, columns of non-similar key blocks set to -inf, softmax per row;
  4. per row keep the largest entries whose cumulative sum is <= cdfthreshd (TopCdf; cdfthreshd = 1
     keeps all, whatever the rounding of the sum), or the floor(topk * n_kb) largest; at least one;
  5. the "fix blocks": every non-similar key block's column and every non-similar query block's row
     is kept whole; with attention_sink, key block 0 is always kept.
  The map is per query head (GQA: the key side is pooled per KV head and shared by its group).

Stage 2, `pv_skip_attention` (Pallas, Triton backend): for each listed key tile, in ascending order,
  S and the new running maxima m_new are always computed (and the accumulators rescaled); exp(S)·V and
  the row sums are skipped when max over the tile's real rows of (rowmax(S) - m_prev) + pvthreshd <= 0,
  in base-2 logit units (S * scale * log2 e), as in the official kernel (its lambda = -pvthreshd).
  Granularity: the whole query tile (block_q rows, one Triton program); the official CUDA kernel
  decides per warp (16 rows) by default, or per CTA in its `kPerBlock` mode, which this matches.
  The first tile of every row is never skipped (m_prev = -inf). pvthreshd=None compiles without the
  filter (then the kernel is `block_sparse_attention`).

Hyperparameters (simthreshd1, cdfthreshd, topk, pvthreshd) are scalars or per-query-head vectors [Hq].
Official defaults of the recommended entry point: simthreshd1=-0.1, topk=0.5, pvthreshd=50 (which
practically never skips); hand-tuned values are around 0.3 / cdf 0.96 / 20. `sparge_calibrate` tunes
them per head (dllm_jax.attention.sparge).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import _common as c
from pallas_kernels.block_sparse import PRELOAD_MAX_WIDTH, NUM_STAGES, block_mask

NORM_EPS = 1e-12  # a zero row has no direction: it counts as orthogonal to every other row


class SpargeSparsity(NamedTuple):
    """Tile counts per [B, Hq] (int32): `total` query-tile x key-tile pairs, `qk` pairs the map keeps
    (S = Q K^T computed), `pv` pairs whose exp(S)·V was computed (qk minus the PV-skipped ones)."""

    total: jax.Array
    qk: jax.Array
    pv: jax.Array

    def map_sparsity(self) -> jax.Array:
        """Fraction of tiles skipped by the predicted map (stage 1)."""
        return 1.0 - jnp.sum(self.qk) / jnp.sum(self.total)

    def pv_sparsity(self) -> jax.Array:
        """Fraction of tiles whose exp(S)·V was not computed (both stages)."""
        return 1.0 - jnp.sum(self.pv) / jnp.sum(self.total)

    def per_head(self) -> jax.Array:
        """The both-stage sparsity per query head, f32 [Hq] (summed over the batch)."""
        return 1.0 - jnp.sum(self.pv, axis=0) / jnp.sum(self.total, axis=0)


# ---- hyperparameters ----

def per_head(name: str, value, num_heads: int, *, low=-np.inf, high=np.inf) -> jax.Array:
    """A scalar or [Hq] hyperparameter as f32 [Hq]; concrete values are range-checked."""
    arr = jnp.asarray(value, jnp.float32)
    if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != num_heads):
        raise ValueError(f"{name} must be a scalar or one value per query head [{num_heads}], got shape {arr.shape}")
    if c.is_concrete(value):
        values = np.asarray(value, np.float32)
        if not np.isfinite(values).all() or values.min() < low or values.max() > high:
            raise ValueError(f"{name}={values.tolist()} must be finite and lie in [{low}, {high}]")
    return jnp.broadcast_to(arr, (num_heads,))


def _selection(cdfthreshd, topk, num_heads):
    if (cdfthreshd is None) == (topk is None):
        raise ValueError("give exactly one of cdfthreshd (TopCdf) and topk (a fraction of the key blocks), "
                         f"got cdfthreshd={cdfthreshd!r}, topk={topk!r}")
    if cdfthreshd is not None:
        return "cdf", per_head("cdfthreshd", cdfthreshd, num_heads, low=0.0, high=1.0)
    return "topk", per_head("topk", topk, num_heads, low=0.0, high=1.0)


# ---- stage 1: the predicted block map ----

def pool_blocks(x, block: int):
    """Mean row and self-similarity of each block of `block` rows of x [B, N, H, D]: f32
    ([B, H, nb, D], [B, H, nb]); a partial last block uses its true size."""
    b, n, h, d = x.shape
    nb = c.cdiv(n, block)
    x = c.pad_axis(x.astype(jnp.float32), 1, nb * block).reshape(b, nb, block, h, d)
    sizes = jnp.clip(n - jnp.arange(nb) * block, 1, block).astype(jnp.float32)[None, :, None]
    mean = jnp.sum(x, axis=2) / sizes[..., None]
    norms = jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))
    direction = jnp.sum(x / jnp.maximum(norms, NORM_EPS), axis=2)
    sim = jnp.sum(direction * direction, axis=-1) / sizes ** 2
    return mean.transpose(0, 2, 1, 3), sim.transpose(0, 2, 1)


def whole_blocks(n: int, block: int):
    """bool [ceil(n / block)]: which blocks of `block` rows hold `block` real rows (all but a partial last)."""
    return (jnp.arange(c.cdiv(n, block)) + 1) * block <= n


def predict_block_map(q, k, *, simthreshd1, cdfthreshd=None, topk=None, smooth_k=True, block_q=64,
                      block_kv=128, scale=None, attention_sink=False):
    """SpargeAttn's stage-1 map for q [B, Nq, Hq, D] and k [B, Nk, Hkv, D]: bool [B, Hq, nqb, nkb]
    (True = computed). Exactly one of cdfthreshd and topk; each hyperparameter a scalar or [Hq]."""
    scale = c.check_scale(scale)
    b, nq, nk, hq, hkv, d = c.check_qkv(q, k, k)
    c.check_block("block_q", block_q)
    c.check_block("block_kv", block_kv)
    sim_threshold = per_head("simthreshd1", simthreshd1, hq)
    rule, amount = _selection(cdfthreshd, topk, hq)
    if smooth_k:
        k = k.astype(jnp.float32) - jnp.mean(k.astype(jnp.float32), axis=1, keepdims=True)
    pooled_q, sim_q = pool_blocks(q, block_q)
    pooled_k, sim_k = pool_blocks(k, block_kv)
    group = hq // hkv
    pooled_k, sim_k = jnp.repeat(pooled_k, group, axis=1), jnp.repeat(sim_k, group, axis=1)
    # A partial last block is never similar, as in the official kernels: they zero its missing rows, whose
    # direction x / |x| is then 0/0, so its self-similarity is NaN and fails "> simthreshd1". (With a
    # prompt and a short answer window, that block holds the answer rows: they attend densely.)
    similar_q = (sim_q > sim_threshold[None, :, None]) & whole_blocks(nq, block_q)  # [B, Hq, nqb]
    similar_k = (sim_k > sim_threshold[None, :, None]) & whole_blocks(nk, block_kv)  # [B, Hq, nkb]
    scores = jnp.einsum("bhqd,bhkd->bhqk", pooled_q, pooled_k, precision=jax.lax.Precision.HIGHEST)
    scores = jnp.where(similar_k[:, :, None, :], scores * c.resolve_scale(scale, d), -jnp.inf)
    no_similar_key = ~jnp.any(similar_k, axis=-1)[:, :, None, None]
    probs = jnp.where(no_similar_key, 0.0, jax.nn.softmax(scores, axis=-1))
    order = jnp.argsort(-probs, axis=-1, stable=True)
    n_kb = probs.shape[-1]
    if rule == "cdf":
        cdf = jnp.cumsum(jnp.take_along_axis(probs, order, axis=-1), axis=-1)
        num = jnp.sum(cdf <= amount[None, :, None, None], axis=-1)
        # tau = 1 keeps every block, as exact arithmetic would; a rounded cumulative sum can end above 1
        num = jnp.where(amount[None, :, None] >= 1.0, n_kb, num)
    else:
        num = jnp.broadcast_to(jnp.floor(amount * n_kb).astype(jnp.int32)[None, :, None], probs.shape[:3])
    num = jnp.maximum(num, 1)
    top = jnp.put_along_axis(jnp.zeros(probs.shape, bool), order, jnp.arange(n_kb) < num[..., None], axis=-1,
                             inplace=False)
    keep = top | ~similar_k[:, :, None, :] | ~similar_q[..., None]
    if attention_sink:
        keep = keep.at[..., 0].set(True)
    return keep


def map_to_lists(block_map):
    """bool [B, H, nqb, nkb] -> (ascending kv_block_indices [B, H, nqb, nkb], kv_block_counts)."""
    return c.mask_to_lists(block_map, block_map.shape[-1])


# ---- stage 2: block-sparse attention with the PV-skip filter ----

def _kernel(kvlen_ref, thr_ref, cnt_ref, idx_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, skip_ref, *, scale_log2,
            block_q, block_kv, num_queries, masked, skip_pv, preload):
    q = q_ref[...]
    kv_len = kvlen_ref[0]
    threshold = thr_ref[0]
    # padded query rows (zeros) would see flat logits and veto every skip: only real rows decide
    real_rows = pl.program_id(0) * block_q + jnp.arange(block_q) < num_queries
    if preload:  # as in block_sparse: one read of the index row keeps the K/V address chain prefetchable
        row = idx_ref[...]
        positions = jnp.arange(row.shape[0])

    def body(j, state):
        carry, skipped = state
        block = jnp.sum(jnp.where(positions == j, row, 0)) if preload else idx_ref[j]
        start = pl.multiple_of(block * block_kv, block_kv)
        k = k_ref[pl.ds(start, block_kv), :]
        v = v_ref[pl.ds(start, block_kv), :]
        s = c.logits(q, k, scale_log2)
        if masked:
            valid = start + jnp.arange(block_kv) < kv_len
            s = jnp.where(valid[None, :], s, -jnp.inf)
            v = c.mask_values(v, valid)
        if not skip_pv:
            return c.logits_update(carry, s, v), skipped
        row_max = jnp.max(s, axis=1)
        _, m, _ = carry
        gain = jnp.where(m == -jnp.inf, jnp.inf, row_max - m)  # a row's first keys always count
        skip = jnp.max(jnp.where(real_rows, gain, -jnp.inf)) + threshold <= 0.0

        def rescale_only(_):
            acc, _, l = carry
            _, alpha, m_new = c.rescale(carry, row_max)
            return (acc * alpha[:, None], m_new, l * alpha), skipped + 1

        return jax.lax.cond(skip, rescale_only, lambda _: (c.logits_update(carry, s, v), skipped), None)

    init = (c.init_carry(q.shape[0], q.shape[1]), jnp.int32(0))
    carry, skipped = jax.lax.fori_loop(0, cnt_ref[0], body, init)
    o, lse = c.finalize(carry)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse
    skip_ref[...] = jnp.full((1,), skipped, jnp.int32)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_kv", "masked", "skip_pv", "preload",
                                             "num_warps", "num_stages", "interpret"))
def _pv_skip(q, k, v, indices, counts, kv_len, threshold, *, scale, block_q, block_kv, masked, skip_pv, preload,
             num_warps, num_stages, interpret):
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    n_qb = indices.shape[2]
    nq_pad, nk_pad = n_qb * block_q, c.cdiv(nk, block_kv) * block_kv
    q = c.pad_axis(q, 1, nq_pad)
    k, v = c.pad_axis(k, 1, nk_pad), c.pad_axis(v, 1, nk_pad)
    width = c.next_pow2(indices.shape[3])
    indices = c.pad_last_repeat(indices, width)
    kv_group, idx_group = hq // hkv, hq // indices.shape[1]
    kernel = functools.partial(_kernel, scale_log2=scale * c.LOG2E, block_q=block_q, block_kv=block_kv,
                               num_queries=nq, masked=masked, skip_pv=skip_pv, preload=preload)
    o, lse, skipped = pl.pallas_call(
        kernel,
        grid=(n_qb, b, hq),
        in_specs=[
            pl.BlockSpec((None, 1), lambda i, bi, h: (bi, 0)),
            pl.BlockSpec((None, 1), lambda i, bi, h: (h, 0)),
            pl.BlockSpec((None, None, None, 1), lambda i, bi, h: (bi, h // idx_group, i, 0)),
            pl.BlockSpec((None, None, None, width), lambda i, bi, h: (bi, h // idx_group, i, 0)),
            pl.BlockSpec((None, block_q, None, d), lambda i, bi, h: (bi, i, h, 0)),
            pl.BlockSpec((None, nk_pad, None, d), lambda i, bi, h: (bi, 0, h // kv_group, 0)),
            pl.BlockSpec((None, nk_pad, None, d), lambda i, bi, h: (bi, 0, h // kv_group, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, block_q, None, d), lambda i, bi, h: (bi, i, h, 0)),
            pl.BlockSpec((None, None, block_q), lambda i, bi, h: (bi, h, i)),
            pl.BlockSpec((None, None, None, 1), lambda i, bi, h: (bi, h, i, 0)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, nq_pad, hq, d), q.dtype),
                   jax.ShapeDtypeStruct((b, hq, nq_pad), jnp.float32),
                   jax.ShapeDtypeStruct((b, hq, n_qb, 1), jnp.int32)],
        compiler_params=c.compiler_params(d, num_warps, num_stages if num_stages is not None else c.fitting_stages(
            NUM_STAGES, rows=block_kv, head_dim=d, dtype=k.dtype)),
        interpret=interpret,
        name="sparge_pv_skip_attention",
    )(kv_len[:, None], threshold[:, None], counts[..., None], indices, q, k, v)
    return o[:, :nq], lse[:, :, :nq], skipped[..., 0]


def _check(q, k, v, kv_block_indices, kv_block_counts, pvthreshd, block_q, block_kv, kv_len):
    b, nq, nk, hq, hkv, d = c.check_qkv(q, k, v)
    c.check_block("block_q", block_q)
    c.check_block("block_kv", block_kv)
    indices, counts = c.check_index_lists(
        kv_block_indices, kv_block_counts, name="kv_block", lead=(b, c.cdiv(nq, block_q)),
        heads=(hq, hkv), limit=c.cdiv(nk, block_kv))
    threshold = per_head("pvthreshd", 0.0 if pvthreshd is None else pvthreshd, hq)
    return indices, counts, c.kv_lengths(kv_len, b, nk), threshold, d


def _outputs(o, lse, skipped, return_lse, return_skipped):
    out = (o, lse) if return_lse else (o,)
    if return_skipped:
        out += (skipped,)
    return out[0] if len(out) == 1 else out


def pv_skip_attention(q, k, v, kv_block_indices, kv_block_counts, *, pvthreshd, block_q, block_kv, scale=None,
                      kv_len=None, return_lse=False, return_skipped=False, interpret=False, num_warps=None,
                      num_stages=None, preload_indices=None):
    """Block-sparse attention over listed key blocks with SpargeAttn's PV-skip filter.

    Args: as `block_sparse_attention` (index lists, block sizes, scale, kv_len, lse), plus
      pvthreshd: None (no filter) or a scalar / per-query-head [Hq] threshold in base-2 logit units;
        a listed tile's exp(S)·V is skipped when max over real rows (rowmax(S) - m_prev) + pvthreshd <= 0.
      return_skipped: also return the PV-skipped tiles per row, int32 [B, Hq, ceil(Nq / block_q)].
    Lists are processed in the order given (ascending is the official order): the filter depends on it.
    Returns o, then lse and skipped as requested.
    """
    scale = c.check_scale(scale)
    indices, counts, lengths, threshold, d = _check(q, k, v, kv_block_indices, kv_block_counts, pvthreshd,
                                                    block_q, block_kv, kv_len)
    masked = kv_len is not None or k.shape[1] % block_kv != 0
    if preload_indices is None:
        preload_indices = c.next_pow2(indices.shape[-1]) <= PRELOAD_MAX_WIDTH
    o, lse, skipped = _pv_skip(q, k, v, indices, counts, lengths, threshold, scale=c.resolve_scale(scale, d),
                               block_q=block_q, block_kv=block_kv, masked=masked, skip_pv=pvthreshd is not None,
                               preload=preload_indices, num_warps=num_warps, num_stages=num_stages,
                               interpret=interpret)
    return _outputs(o, lse, skipped, return_lse, return_skipped)


def pv_skip_attention_reference(q, k, v, kv_block_indices, kv_block_counts, *, pvthreshd, block_q, block_kv,
                                scale=None, kv_len=None, return_lse=False, return_skipped=False, interpret=False,
                                num_warps=None, num_stages=None, preload_indices=None):
    """The same function as `pv_skip_attention` in fp32 jnp: a scan over the list positions of every row."""
    scale = c.check_scale(scale)
    del interpret, num_warps, num_stages, preload_indices
    indices, counts, lengths, threshold, d = _check(q, k, v, kv_block_indices, kv_block_counts, pvthreshd,
                                                    block_q, block_kv, kv_len)
    b, nq, hq, _ = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    n_qb, n_kb = indices.shape[2], c.cdiv(nk, block_kv)
    scale_log2 = c.resolve_scale(scale, d) * c.LOG2E
    qf = c.pad_axis(q.astype(jnp.float32), 1, n_qb * block_q).reshape(b, n_qb, block_q, hq, d)
    qf = qf.transpose(0, 3, 1, 2, 4)  # [B, Hq, nqb, bq, D]

    def tiles(x):  # [B, Nk, Hkv, D] -> [B, Hq, nkb, bk, D]
        x = c.pad_axis(x.astype(jnp.float32), 1, n_kb * block_kv).reshape(b, n_kb, block_kv, hkv, d)
        return jnp.repeat(x.transpose(0, 3, 1, 2, 4), hq // hkv, axis=1)

    kt, vt = tiles(k), tiles(v)
    idx = jnp.repeat(indices, hq // indices.shape[1], axis=1)
    cnt = jnp.repeat(counts, hq // counts.shape[1], axis=1)
    real_rows = (jnp.arange(n_qb)[:, None] * block_q + jnp.arange(block_q)[None, :]) < nq  # [nqb, bq]
    thr = threshold[None, :, None]

    def step(state, j):
        acc, m, l, skipped = state
        block = idx[..., j]  # [B, Hq, nqb]
        kj = jnp.take_along_axis(kt, block[..., None, None], axis=2)  # [B, Hq, nqb, bk, D]
        vj = jnp.take_along_axis(vt, block[..., None, None], axis=2)
        s = jnp.einsum("bhqrd,bhqcd->bhqrc", qf, kj, precision=jax.lax.Precision.HIGHEST) * scale_log2
        keys = block[..., None] * block_kv + jnp.arange(block_kv)  # [B, Hq, nqb, bk]
        in_range = keys < lengths[:, None, None, None]
        s = jnp.where(in_range[..., None, :], s, -jnp.inf)
        vj = jnp.where(in_range[..., None], vj, 0.0)  # as the kernel: keys past kv_len carry no value
        row_max = jnp.max(s, axis=-1)
        gain = jnp.where(m == -jnp.inf, jnp.inf, row_max - m)
        skip = jnp.max(jnp.where(real_rows, gain, -jnp.inf), axis=-1) + thr <= 0.0
        if pvthreshd is None:
            skip = jnp.zeros_like(skip)
        live = j < cnt
        m_new = jnp.maximum(m, row_max)
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m - shift)
        p = jnp.exp2(s - shift[..., None])
        computed = (live & ~skip)[..., None]
        new_l = l * alpha + jnp.where(computed, jnp.sum(p, axis=-1), 0.0)
        pv = jnp.einsum("bhqrc,bhqcd->bhqrd", p, vj, precision=jax.lax.Precision.HIGHEST)
        new_acc = acc * alpha[..., None] + jnp.where(computed[..., None], pv, 0.0)
        keep = live[..., None]
        state = (jnp.where(keep[..., None], new_acc, acc), jnp.where(keep, m_new, m), jnp.where(keep, new_l, l),
                 skipped + (live & skip).astype(jnp.int32))
        return state, None

    init = (jnp.zeros(qf.shape, jnp.float32), jnp.full(qf.shape[:-1], -jnp.inf, jnp.float32),
            jnp.zeros(qf.shape[:-1], jnp.float32), jnp.zeros(qf.shape[:3], jnp.int32))
    (acc, m, l, skipped), _ = jax.lax.scan(step, init, jnp.arange(indices.shape[-1]))
    empty = l == 0.0
    o = acc / jnp.where(empty, 1.0, l)[..., None]
    lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * c.LN2)
    o = o.transpose(0, 2, 3, 1, 4).reshape(b, n_qb * block_q, hq, d)[:, :nq].astype(q.dtype)
    lse = lse.reshape(b, hq, n_qb * block_q)[:, :, :nq]
    return _outputs(o, lse, skipped, return_lse, return_skipped)


# ---- both stages ----

def _sparsity(counts, skipped, n_kb):
    qk = jnp.sum(counts, axis=-1)
    total = jnp.full(qk.shape, counts.shape[-1] * n_kb, jnp.int32)
    return SpargeSparsity(total=total, qk=qk, pv=qk - jnp.sum(skipped, axis=-1))


def _sparge(attend, q, k, v, *, simthreshd1, cdfthreshd, topk, pvthreshd, smooth_k, block_q, block_kv, scale,
            attention_sink, return_lse, return_sparsity, **kernel_args):
    block_map = predict_block_map(q, k, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd, topk=topk,
                                  smooth_k=smooth_k, block_q=block_q, block_kv=block_kv, scale=scale,
                                  attention_sink=attention_sink)
    indices, counts = map_to_lists(block_map)
    o, lse, skipped = attend(q, k, v, indices, counts, pvthreshd, scale, **kernel_args)
    out = (o, lse) if return_lse else (o,)
    if return_sparsity:
        out += (_sparsity(counts, skipped, block_map.shape[-1]),)
    return out[0] if len(out) == 1 else out


def sparge_attention(q, k, v, *, simthreshd1, cdfthreshd=None, topk=None, pvthreshd, smooth_k=True, block_q=64,
                     block_kv=128, scale=None, attention_sink=False, return_lse=False, return_sparsity=False,
                     interpret=False, num_warps=None, num_stages=None):
    """SpargeAttn: `predict_block_map`, then `pv_skip_attention` over the map (see the module docstring).

    q [B, Nq, Hq, D], k/v [B, Nk, Hkv, D] (no padding masks: every key is attended or pruned).
    simthreshd1, cdfthreshd | topk, pvthreshd (None: no PV filter): scalars or per-query-head [Hq].
    block_q, block_kv: the map's tiles (64 x 128 as the official kernel on Hopper).
    Returns o, then the natural-log lse f32 [B, Hq, Nq] and a `SpargeSparsity` as requested.
    """
    scale = c.check_scale(scale)
    b, nq, nk, hq, hkv, d = c.check_qkv(q, k, v)
    threshold = per_head("pvthreshd", 0.0 if pvthreshd is None else pvthreshd, hq)

    def attend(q, k, v, indices, counts, pvthreshd, scale, **kernel_args):
        # the lists come from the map, valid by construction: no host-side index checks
        return _pv_skip(q, k, v, indices, counts, jnp.full((b,), nk, jnp.int32), threshold,
                        scale=c.resolve_scale(scale, d), block_q=block_q, block_kv=block_kv,
                        masked=nk % block_kv != 0, skip_pv=pvthreshd is not None,
                        preload=c.next_pow2(indices.shape[-1]) <= PRELOAD_MAX_WIDTH, **kernel_args)

    return _sparge(attend, q, k, v, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd, topk=topk, pvthreshd=pvthreshd,
                   smooth_k=smooth_k, block_q=block_q, block_kv=block_kv, scale=scale, attention_sink=attention_sink,
                   return_lse=return_lse, return_sparsity=return_sparsity, num_warps=num_warps,
                   num_stages=num_stages, interpret=interpret)


def sparge_attention_reference(q, k, v, *, simthreshd1, cdfthreshd=None, topk=None, pvthreshd, smooth_k=True,
                               block_q=64, block_kv=128, scale=None, attention_sink=False, return_lse=False,
                               return_sparsity=False, interpret=False, num_warps=None, num_stages=None):
    """The same function as `sparge_attention`, stage 2 by `pv_skip_attention_reference`."""
    scale = c.check_scale(scale)
    del interpret, num_warps, num_stages

    def attend(q, k, v, indices, counts, pvthreshd, scale):
        return pv_skip_attention_reference(q, k, v, indices, counts, pvthreshd=pvthreshd, block_q=block_q,
                                           block_kv=block_kv, scale=scale, return_lse=True, return_skipped=True)

    return _sparge(attend, q, k, v, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd, topk=topk, pvthreshd=pvthreshd,
                   smooth_k=smooth_k, block_q=block_q, block_kv=block_kv, scale=scale, attention_sink=attention_sink,
                   return_lse=return_lse, return_sparsity=return_sparsity)


def sparge_mask(q, k, **prediction):
    """The element-level bool [B, Hq, Nq, Nk] mask of the predicted map (for references and analysis)."""
    block_q, block_kv = prediction.get("block_q", 64), prediction.get("block_kv", 128)
    indices, counts = map_to_lists(predict_block_map(q, k, **prediction))
    return block_mask(indices, counts, block_q=block_q, block_kv=block_kv, num_queries=q.shape[1],
                      num_keys=k.shape[1], num_heads=q.shape[2])
