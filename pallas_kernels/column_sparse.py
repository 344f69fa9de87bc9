"""Column-sparse flash attention: each (batch, head, query group) attends to a listed set of single
keys (columns), gathered row by row from K and V.

Index layout (the contract):
  col_indices int32 [B, Hi, ceil(Nq / group_size), max_cols]: key positions in [0, Nk). Hi = Hq
      (per query head) or Hkv (shared by the query-head group). Entries at or beyond the count are
      padding: they are loaded with the last gathered tile (so they must be in range; repeat the
      last valid entry) but masked out of the softmax and their values zeroed (NaN or Inf at the
      keys they point to cannot leak). Ascending order helps the gathers hit L2.
      A key listed twice counts twice: concrete inputs are checked and raise.
  col_counts int32 [B, Hi, ceil(Nq / group_size)]: valid entries per row, 0..max_cols. Count 0 gives
      o = 0 and lse = -inf.
Grid (query groups, batch, query heads). Each program loops over ceil(count / block_cols) tiles,
gathers `block_cols` K/V rows per tile by index and runs the online softmax on them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as c

NUM_STAGES = 3  # with 128-column tiles, 8 warps and index prefetch: fastest on H200 at 4k-64k


def _kernel(cnt_ref, idx_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale_log2, block_cols, prefetch):
    q = q_ref[...]
    count = cnt_ref[0]
    last_tile = idx_ref.shape[0] // block_cols - 1

    def tile_cols(t):
        return idx_ref[pl.ds(pl.multiple_of(jnp.minimum(t, last_tile) * block_cols, block_cols), block_cols)]

    def body(t, state):
        carry, cols = state if prefetch else (state, tile_cols(t))
        if prefetch:  # read the next tile's indices before this tile's gathers (hides the index latency)
            upcoming = tile_cols(t + 1)
        k = k_ref[cols, :]
        v = v_ref[cols, :]
        valid = t * block_cols + jnp.arange(block_cols) < count  # entries past the count are padding
        carry = c.tile_update(carry, q, k, v, scale_log2, valid)
        return (carry, upcoming) if prefetch else carry

    init = c.init_carry(q.shape[0], q.shape[1])
    n_tiles = (count + block_cols - 1) // block_cols
    if prefetch:
        carry, _ = jax.lax.fori_loop(0, n_tiles, body, (init, tile_cols(0)))
    else:
        carry = jax.lax.fori_loop(0, n_tiles, body, init)
    o, lse = c.finalize(carry)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse


@functools.partial(jax.jit, static_argnames=("scale", "group_size", "block_cols", "prefetch", "num_warps",
                                             "num_stages", "interpret"))
def _column_sparse(q, k, v, indices, counts, *, scale, group_size, block_cols, prefetch, num_warps, num_stages,
                   interpret):
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    n_groups = indices.shape[2]
    nq_pad = n_groups * group_size
    q = c.pad_axis(q, 1, nq_pad)
    width = c.cdiv(indices.shape[3], block_cols) * block_cols
    indices = c.pad_last_repeat(indices, width)
    kv_group, idx_group = hq // hkv, hq // indices.shape[1]
    kernel = functools.partial(_kernel, scale_log2=scale * c.LOG2E, block_cols=block_cols, prefetch=prefetch)
    o, lse = pl.pallas_call(
        kernel,
        grid=(n_groups, b, hq),
        in_specs=[
            pl.BlockSpec((None, None, None, 1), lambda i, bi, h: (bi, h // idx_group, i, 0)),
            pl.BlockSpec((None, None, None, width), lambda i, bi, h: (bi, h // idx_group, i, 0)),
            pl.BlockSpec((None, group_size, None, d), lambda i, bi, h: (bi, i, h, 0)),
            pl.BlockSpec((None, nk, None, d), lambda i, bi, h: (bi, 0, h // kv_group, 0)),
            pl.BlockSpec((None, nk, None, d), lambda i, bi, h: (bi, 0, h // kv_group, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, group_size, None, d), lambda i, bi, h: (bi, i, h, 0)),
            pl.BlockSpec((None, None, group_size), lambda i, bi, h: (bi, h, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, nq_pad, hq, d), q.dtype),
                   jax.ShapeDtypeStruct((b, hq, nq_pad), jnp.float32)],
        compiler_params=c.compiler_params(d, num_warps, num_stages if num_stages is not None else c.fitting_stages(
            NUM_STAGES, rows=block_cols, head_dim=d, dtype=k.dtype)),
        interpret=interpret,
        name="column_sparse_attention",
    )(counts[..., None], indices, q, k, v)
    return o[:, :nq], lse[:, :, :nq]


def _check(q, k, v, col_indices, col_counts, group_size, block_cols):
    b, nq, nk, hq, hkv, d = c.check_qkv(q, k, v)
    c.check_block("group_size", group_size)
    c.check_block("block_cols", block_cols)
    indices, counts = c.check_index_lists(col_indices, col_counts, name="col", lead=(b, c.cdiv(nq, group_size)),
                                          heads=(hq, hkv), limit=nk)
    return indices, counts, d


def column_sparse_attention(q, k, v, col_indices, col_counts, *, group_size, scale=None, return_lse=False,
                            interpret=False, block_cols=128, num_warps=None, num_stages=None,
                            prefetch_indices=True):
    """Attention of each query group over its listed key columns only.

    Args:
      q: [B, Nq, Hq, D]; k, v: [B, Nk, Hkv, D] (GQA: Hq % Hkv == 0). Nq need not be a multiple of
        group_size (the last group is partial).
      col_indices, col_counts: see the module docstring.
      group_size: queries per group sharing one column list, a power of two >= 16.
      scale: default 1/sqrt(D). return_lse: also return the natural-log LSE f32 [B, Hq, Nq].
      block_cols: gathered rows per tile (power of two >= 16).
      num_warps, num_stages, prefetch_indices: tuning (prefetch reads tile t+1's indices during t).
        Defaults (128 columns, 8 warps, 3 stages, prefetch) were fastest on H200 at 4k-64k.

    Returns o [B, Nq, Hq, D] in q.dtype, or (o, lse).
    """
    scale = c.check_scale(scale)
    indices, counts, d = _check(q, k, v, col_indices, col_counts, group_size, block_cols)
    o, lse = _column_sparse(q, k, v, indices, counts, scale=c.resolve_scale(scale, d), group_size=group_size,
                            block_cols=block_cols, prefetch=prefetch_indices, num_warps=num_warps, num_stages=num_stages,
                            interpret=interpret)
    return (o, lse) if return_lse else o


def column_mask(col_indices, col_counts, *, group_size, num_queries, num_keys, num_heads):
    """The boolean [B, Hq, Nq, Nk] mask that the column lists describe."""
    live = jnp.arange(col_indices.shape[-1]) < col_counts[..., None]
    cols = jnp.any(jax.nn.one_hot(col_indices, num_keys, dtype=bool) & live[..., None], axis=3)
    cols = jnp.repeat(cols, num_heads // cols.shape[1], axis=1)
    return jnp.repeat(cols, group_size, axis=2)[:, :, :num_queries]


def column_sparse_attention_reference(q, k, v, col_indices, col_counts, *, group_size, scale=None,
                                      return_lse=False, interpret=False, block_cols=128, num_warps=None,
                                      num_stages=None, prefetch_indices=True):
    """The same function as `column_sparse_attention`, computed densely in fp32 jnp."""
    scale = c.check_scale(scale)
    del interpret, num_warps, num_stages, prefetch_indices
    indices, counts, d = _check(q, k, v, col_indices, col_counts, group_size, block_cols)
    allowed = column_mask(indices, counts, group_size=group_size, num_queries=q.shape[1], num_keys=k.shape[1],
                          num_heads=q.shape[2])
    o, lse = c.dense_reference(q, k, v, allowed, c.resolve_scale(scale, d))
    return (o, lse) if return_lse else o
