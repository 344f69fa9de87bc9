"""Average-pooled softmax probabilities per (query block, key block): SparseD's block importance.

  score[b, h, i, j] = sum of P[b, h, q, k] over q in query block i and k in key block j,
                      divided by block_q * block_kv,
  P = exp(scale * q.k - lse): the exact softmax over the keys below kv_len, normalised by the LSE
      that `flash_attention(..., return_lse=True)` returns for the same q, k, scale and kv_len.

The divisor is the full tile even for a partial last block (SparseD zero-pads P to whole tiles, so
a short tile scores lower); the per-row ranking is that of the tile sums. SparseD also rounds P to
the model dtype before pooling; this kernel keeps fp32.

The N x N matrix is never materialised: grid (query blocks, batch, heads), each program recomputes
its row of logits tile by tile and keeps the row's block sums in registers. Cost: one QK^T (half the
FLOPs of dense attention). Peak extra memory: the output, 4 * B * H * ceil(Nq/block_q) *
ceil(Nk/block_kv) bytes (32 heads, 64k, 128 blocks: 32 MiB), plus the LSE input 4 * B * H * Nq.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as c


def _kernel(kvlen_ref, q_ref, lse_ref, k_ref, out_ref, *, scale_log2, block_q, block_kv):
    q = q_ref[...]
    shift = c.prob_shift(lse_ref[...])
    kv_len = kvlen_ref[0]
    width = out_ref.shape[0]

    def body(j, acc):
        start = pl.multiple_of(j * block_kv, block_kv)
        k = k_ref[pl.ds(start, block_kv), :]
        s = c.logits(q, k, scale_log2)
        s = jnp.where((start + jnp.arange(block_kv) < kv_len)[None, :], s, -jnp.inf)
        mass = jnp.sum(jnp.exp2(s - shift[:, None]))
        return jnp.where(jnp.arange(width) == j, mass, acc)

    acc = jax.lax.fori_loop(0, (kv_len + block_kv - 1) // block_kv, body, jnp.zeros((width,), jnp.float32))
    out_ref[...] = acc / (block_q * block_kv)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_kv", "num_warps", "num_stages",
                                             "interpret"))
def _block_scores(q, k, lse, kv_len, *, scale, block_q, block_kv, num_warps, num_stages, interpret):
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    n_qb, n_kb = c.cdiv(nq, block_q), c.cdiv(nk, block_kv)
    q = c.pad_axis(q, 1, n_qb * block_q)
    lse = c.pad_axis(lse, 2, n_qb * block_q, value=jnp.inf)  # padded queries get probability 0
    k = c.pad_axis(k, 1, n_kb * block_kv)
    width = c.next_pow2(n_kb)
    group = hq // hkv
    kernel = functools.partial(_kernel, scale_log2=scale * c.LOG2E, block_q=block_q, block_kv=block_kv)
    out = pl.pallas_call(
        kernel,
        grid=(n_qb, b, hq),
        in_specs=[
            pl.BlockSpec((None, 1), lambda i, bi, h: (bi, 0)),
            pl.BlockSpec((None, block_q, None, d), lambda i, bi, h: (bi, i, h, 0)),
            pl.BlockSpec((None, None, block_q), lambda i, bi, h: (bi, h, i)),
            pl.BlockSpec((None, n_kb * block_kv, None, d), lambda i, bi, h: (bi, 0, h // group, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, None, width), lambda i, bi, h: (bi, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hq, n_qb, width), jnp.float32),
        compiler_params=c.compiler_params(d, num_warps, num_stages),
        interpret=interpret,
        name="block_scores",
    )(kv_len[:, None], q, lse, k)
    return out[..., :n_kb]


def _check(q, k, lse, block_q, block_kv, kv_len):
    b, nq, nk, hq, hkv, d = c.check_qkv(q, k, k)
    c.check_block("block_q", block_q)
    c.check_block("block_kv", block_kv)
    if lse.shape != (b, hq, nq) or lse.dtype != jnp.float32:
        raise ValueError(f"lse must be float32 [B, Hq, Nq] = {(b, hq, nq)}, got {lse.dtype} {lse.shape}")
    return c.kv_lengths(kv_len, b, nk), d


def block_scores(q, k, lse, *, block_q, block_kv, scale=None, kv_len=None, interpret=False, num_warps=None,
                 num_stages=None):
    """Average-pooled softmax probability per (query block, key block); see the module docstring.

    Args:
      q: [B, Nq, Hq, D]; k: [B, Nk, Hkv, D]; lse: f32 [B, Hq, Nq] from `flash_attention` with the
        same scale and kv_len.
      block_q, block_kv: pooling blocks (powers of two >= 16). scale: default 1/sqrt(D).
      kv_len: None, int or int [B].

    Returns f32 [B, Hq, ceil(Nq / block_q), ceil(Nk / block_kv)].
    """
    scale = c.check_scale(scale)
    lengths, d = _check(q, k, lse, block_q, block_kv, kv_len)
    return _block_scores(q, k, lse, lengths, scale=c.resolve_scale(scale, d), block_q=block_q,
                         block_kv=block_kv, num_warps=num_warps, num_stages=num_stages, interpret=interpret)


def probabilities(q, k, lse, lengths, scale):
    """Dense fp32 P [B, Hq, Nq, Nk] = exp(scale * q.k - lse), zero at keys >= length."""
    hq, hkv = q.shape[2], k.shape[2]
    kf = jnp.repeat(k.astype(jnp.float32), hq // hkv, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf, precision=jax.lax.Precision.HIGHEST) * scale
    live = (jnp.arange(k.shape[1])[None, :] < lengths[:, None])[:, None, None, :]
    return jnp.where(live, jnp.exp(s - lse[..., None]), 0.0)


def block_scores_reference(q, k, lse, *, block_q, block_kv, scale=None, kv_len=None, interpret=False,
                           num_warps=None, num_stages=None):
    """The same function as `block_scores`, from the dense probability matrix."""
    scale = c.check_scale(scale)
    del interpret, num_warps, num_stages
    lengths, d = _check(q, k, lse, block_q, block_kv, kv_len)
    p = probabilities(q, k, lse, lengths, c.resolve_scale(scale, d))
    n_qb, n_kb = c.cdiv(q.shape[1], block_q), c.cdiv(k.shape[1], block_kv)
    p = c.pad_axis(c.pad_axis(p, 2, n_qb * block_q), 3, n_kb * block_kv)
    tiles = p.reshape(p.shape[0], p.shape[1], n_qb, block_q, n_kb, block_kv)
    return tiles.mean(axis=(3, 5))
