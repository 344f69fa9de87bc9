"""Mean softmax probability per (query group, key): PulseCol's column score.

  score[b, h, u, k] = (1 / |G_u|) * sum over queries q in group u of P[b, h, q, k],
  P = exp(scale * q.k - lse) over the keys below kv_len, with the LSE of `flash_attention(...,
      return_lse=True)` for the same q, k, scale and kv_len. |G_u| is the group's true size (the
      last group may be partial), so each group's scores sum to 1 over the keys.

The N x N matrix is never materialised: grid (query groups, batch, heads), each program recomputes
its logits tile by tile and stores the column sums of each tile. Cost: one QK^T. Peak extra memory:
the output itself, 4 * B * H * ceil(Nq/group_size) * Nk bytes, which grows as N^2 / group_size
(32 heads, 16k, groups of 64: 512 MiB; 64k: 8 GiB). Score a few heads at a time at long contexts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as c
from pallas_kernels.block_scores import probabilities


def _kernel(kvlen_ref, q_ref, lse_ref, k_ref, out_ref, *, scale_log2, block_kv, group_size, num_queries):
    q = q_ref[...]
    shift = c.prob_shift(lse_ref[...])
    kv_len = kvlen_ref[0]
    rows = jnp.minimum(group_size, num_queries - pl.program_id(0) * group_size).astype(jnp.float32)

    def body(j, carry):
        start = pl.multiple_of(j * block_kv, block_kv)
        k = k_ref[pl.ds(start, block_kv), :]
        s = c.logits(q, k, scale_log2)
        s = jnp.where((start + jnp.arange(block_kv) < kv_len)[None, :], s, -jnp.inf)
        out_ref[pl.ds(start, block_kv)] = jnp.sum(jnp.exp2(s - shift[:, None]), axis=0) / rows
        return carry

    jax.lax.fori_loop(0, out_ref.shape[0] // block_kv, body, 0)


@functools.partial(jax.jit, static_argnames=("scale", "group_size", "block_kv", "num_warps", "num_stages",
                                             "interpret"))
def _column_scores(q, k, lse, kv_len, *, scale, group_size, block_kv, num_warps, num_stages, interpret):
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    n_groups, nk_pad = c.cdiv(nq, group_size), c.cdiv(nk, block_kv) * block_kv
    q = c.pad_axis(q, 1, n_groups * group_size)
    lse = c.pad_axis(lse, 2, n_groups * group_size, value=jnp.inf)  # padded queries get probability 0
    k = c.pad_axis(k, 1, nk_pad)
    group = hq // hkv
    kernel = functools.partial(_kernel, scale_log2=scale * c.LOG2E, block_kv=block_kv, group_size=group_size,
                               num_queries=nq)
    out = pl.pallas_call(
        kernel,
        grid=(n_groups, b, hq),
        in_specs=[
            pl.BlockSpec((None, 1), lambda i, bi, h: (bi, 0)),
            pl.BlockSpec((None, group_size, None, d), lambda i, bi, h: (bi, i, h, 0)),
            pl.BlockSpec((None, None, group_size), lambda i, bi, h: (bi, h, i)),
            pl.BlockSpec((None, nk_pad, None, d), lambda i, bi, h: (bi, 0, h // group, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, None, nk_pad), lambda i, bi, h: (bi, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hq, n_groups, nk_pad), jnp.float32),
        compiler_params=c.compiler_params(d, num_warps, num_stages),
        interpret=interpret,
        name="column_scores",
    )(kv_len[:, None], q, lse, k)
    return out[..., :nk]


def _check(q, k, lse, group_size, block_kv, kv_len):
    b, nq, nk, hq, hkv, d = c.check_qkv(q, k, k)
    c.check_block("group_size", group_size)
    c.check_block("block_kv", block_kv)
    if lse.shape != (b, hq, nq) or lse.dtype != jnp.float32:
        raise ValueError(f"lse must be float32 [B, Hq, Nq] = {(b, hq, nq)}, got {lse.dtype} {lse.shape}")
    return c.kv_lengths(kv_len, b, nk), d


def column_scores(q, k, lse, *, group_size, scale=None, kv_len=None, interpret=False, block_kv=64,
                  num_warps=None, num_stages=None):
    """Mean softmax probability per (query group, key); see the module docstring.

    Args:
      q: [B, Nq, Hq, D]; k: [B, Nk, Hkv, D]; lse: f32 [B, Hq, Nq] from `flash_attention`.
      group_size: queries per group (power of two >= 16). block_kv: key tile.
      scale: default 1/sqrt(D). kv_len: None, int or int [B] (keys beyond it score 0).

    Returns f32 [B, Hq, ceil(Nq / group_size), Nk].
    """
    scale = c.check_scale(scale)
    lengths, d = _check(q, k, lse, group_size, block_kv, kv_len)
    return _column_scores(q, k, lse, lengths, scale=c.resolve_scale(scale, d), group_size=group_size,
                          block_kv=block_kv, num_warps=num_warps, num_stages=num_stages, interpret=interpret)


def column_scores_reference(q, k, lse, *, group_size, scale=None, kv_len=None, interpret=False, block_kv=64,
                            num_warps=None, num_stages=None):
    """The same function as `column_scores`, from the dense probability matrix."""
    scale = c.check_scale(scale)
    del interpret, num_warps, num_stages
    lengths, d = _check(q, k, lse, group_size, block_kv, kv_len)
    p = probabilities(q, k, lse, lengths, c.resolve_scale(scale, d))
    nq = q.shape[1]
    n_groups = c.cdiv(nq, group_size)
    sums = c.pad_axis(p, 2, n_groups * group_size).reshape(p.shape[0], p.shape[1], n_groups, group_size, -1)
    sizes = jnp.minimum(group_size, nq - jnp.arange(n_groups) * group_size).astype(jnp.float32)
    return sums.sum(axis=3) / sizes[:, None]
