"""Dense attention that also returns each query's log-mass per key tile: SparseD's estimation step
(attention output plus pooled block importance) in one pass over Q K^T.

  mass[b, h, j, i] = log(sum over keys t of tile j (t < kv_len) of exp(scale * q_i . k_t)),
                     natural log, float32, -inf for a tile with no valid key;
  lse[b, h, i]     = log-sum-exp over all tiles of mass[b, h, :, i] (the usual attention LSE).

Pooled softmax probabilities follow without revisiting Q or K (`pooled_block_scores`): the
probability mass of tile j for query i is exp(mass - lse), and normalising by the LSE of a suffix of
tiles instead gives the softmax over those keys only (SparseD's generation-block pass).

Only the Mosaic GPU kernel computes it (Hopper); the reference materialises the logits densely. The
kernel sums each tile relative to the row's running maximum: a tile more than ~87 nats below it
underflows, and reports its largest logit instead (within log(block_kv) of its mass).
Memory: mass is 4 * B * Hq * Nq * ceil(Nk / block_kv) bytes (32 heads, 64k, 128-key tiles: 4.3 GB),
written once and read once by the pooling.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _common as c
from pallas_kernels import mosaic


def _check(q, k, v, block_kv, kv_len):
    b, nq, nk, hq, hkv, d = c.check_qkv(q, k, v)
    c.check_block("block_kv", block_kv)
    return c.kv_lengths(kv_len, b, nk), c.cdiv(nk, block_kv), d


def flash_block_mass(q, k, v, *, block_kv, scale=None, kv_len=None, stages=None, interpret=False):
    """(o [B, Nq, Hq, D] in q.dtype, lse f32 [B, Hq, Nq], mass f32 [B, Hq, ceil(Nk/block_kv), Nq]).

    Args as `flash_attention`; block_kv is the key tile of the mass (64 or 128: the kernel's TMA
    tile). Needs the Mosaic GPU kernel: an sm90+ GPU, bf16/f16, head_dim a multiple of 64 (else a
    ValueError says which).
    """
    scale = c.check_scale(scale)
    lengths, _, d = _check(q, k, v, block_kv, kv_len)
    scale = c.resolve_scale(scale, d)
    mosaic.choose("mosaic", q, scale=scale, interpret=interpret, triton_knobs=False, name="flash_block_mass",
                  block_kv=block_kv)
    tiling = mosaic.Tiling(block_kv=block_kv, stages=stages or mosaic.default_tiling(d).stages)
    return mosaic.attention(q, k, v, lengths, scale=scale, has_kv_len=kv_len is not None, tiling=tiling,
                            with_mass=True)


def flash_block_mass_reference(q, k, v, *, block_kv, scale=None, kv_len=None, stages=None, interpret=False):
    """The same function as `flash_block_mass`, computed densely in fp32 jnp."""
    scale = c.check_scale(scale)
    del stages, interpret
    lengths, n_kb, d = _check(q, k, v, block_kv, kv_len)
    scale = c.resolve_scale(scale, d)
    nk = k.shape[1]
    allowed = (jnp.arange(nk)[None, :] < lengths[:, None])[:, None, None, :]
    o, lse = c.dense_reference(q, k, v, allowed, scale)
    hq, hkv = q.shape[2], k.shape[2]
    kf = jnp.repeat(k.astype(jnp.float32), hq // hkv, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf, precision=jax.lax.Precision.HIGHEST) * scale
    s = c.pad_axis(jnp.where(allowed, s, -jnp.inf), 3, n_kb * block_kv, value=-jnp.inf)
    mass = jax.nn.logsumexp(s.reshape(*s.shape[:3], n_kb, block_kv), axis=-1)
    return o, lse, jnp.moveaxis(mass, 3, 2)


def suffix_lse(mass, first_tile: int):
    """The LSE over the keys of tiles first_tile.. only: f32 [B, Hq, Nq]."""
    return jax.nn.logsumexp(mass[:, :, first_tile:], axis=2)


def pooled_block_scores(mass, lse, *, block_q: int, block_kv: int):
    """The probability mass exp(mass - lse), averaged over block_q queries x block_kv keys:
    f32 [B, Hq, ceil(Nq/block_q), n_tiles], the layout and divisor of `block_scores` (a partial tile
    divides by the full tile). Rows with lse = -inf (no key) contribute 0."""
    b, h, n_kb, nq = mass.shape
    shift = jnp.where(jnp.isneginf(lse), jnp.inf, lse)[:, :, None, :]
    p = jnp.exp(mass - shift)
    n_qb = c.cdiv(nq, block_q)
    p = c.pad_axis(p, 3, n_qb * block_q).reshape(b, h, n_kb, n_qb, block_q)
    return jnp.swapaxes(p.sum(axis=-1), 2, 3) / (block_q * block_kv)
