"""Block-sparse flash attention: each (batch, head, query block) attends only to a listed set of
key blocks.

Index layout (the contract; cf. splash attention's MaskInfo):
  kv_block_indices int32 [B, Hi, ceil(Nq / block_q), max_blocks]: key-block numbers
      (block j covers keys j*block_kv ... j*block_kv + block_kv - 1). Hi = Hq gives one list per
      query head; Hi = Hkv gives one list per key/value head, shared by its query-head group.
      Entries at or beyond the row's count are padding and are never read; pad by repeating the
      last valid entry (or anything in range). Ascending order is not required but reads better.
      Listing a block twice counts its keys twice: concrete inputs are checked and raise.
  kv_block_counts int32 [B, Hi, ceil(Nq / block_q)]: valid entries per row, 0..max_blocks. A row
      with count 0 gives o = 0 and lse = -inf.
Grid (query blocks, batch, query heads). Each program reads its count and then one block index per
step of a loop whose trip count is that count, so unlisted blocks cost nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as c
from pallas_kernels import mosaic

PRELOAD_MAX_WIDTH = 512
NUM_STAGES = 3  # measured on H200: 3 stages beat 2 by 5-25% (benchmarks/results/attention_*)


def _kernel(kvlen_ref, cnt_ref, idx_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale_log2, block_kv,
            masked, preload):
    q = q_ref[...]
    kv_len = kvlen_ref[0]
    if preload:
        # Reading the index row once keeps a global load out of the address chain of every K/V tile,
        # so Triton's pipeliner can prefetch the next tile; element j is picked in registers.
        row = idx_ref[...]
        positions = jnp.arange(row.shape[0])

    def body(j, carry):
        block = jnp.sum(jnp.where(positions == j, row, 0)) if preload else idx_ref[j]
        start = pl.multiple_of(block * block_kv, block_kv)
        k = k_ref[pl.ds(start, block_kv), :]
        v = v_ref[pl.ds(start, block_kv), :]
        valid = start + jnp.arange(block_kv) < kv_len if masked else None
        return c.tile_update(carry, q, k, v, scale_log2, valid)

    carry = jax.lax.fori_loop(0, cnt_ref[0], body, c.init_carry(q.shape[0], q.shape[1]))
    o, lse = c.finalize(carry)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_kv", "masked", "preload", "num_warps",
                                             "num_stages", "interpret"))
def _block_sparse(q, k, v, indices, counts, kv_len, *, scale, block_q, block_kv, masked, preload, num_warps,
                  num_stages, interpret):
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    n_qb = indices.shape[2]
    nq_pad, nk_pad = n_qb * block_q, c.cdiv(nk, block_kv) * block_kv
    q = c.pad_axis(q, 1, nq_pad)
    k, v = c.pad_axis(k, 1, nk_pad), c.pad_axis(v, 1, nk_pad)
    width = c.next_pow2(indices.shape[3])
    indices = c.pad_last_repeat(indices, width)
    kv_group, idx_group = hq // hkv, hq // indices.shape[1]
    kernel = functools.partial(_kernel, scale_log2=scale * c.LOG2E, block_kv=block_kv, masked=masked,
                               preload=preload)
    o, lse = pl.pallas_call(
        kernel,
        grid=(n_qb, b, hq),
        in_specs=[
            pl.BlockSpec((None, 1), lambda i, bi, h: (bi, 0)),
            pl.BlockSpec((None, None, None, 1), lambda i, bi, h: (bi, h // idx_group, i, 0)),
            pl.BlockSpec((None, None, None, width), lambda i, bi, h: (bi, h // idx_group, i, 0)),
            pl.BlockSpec((None, block_q, None, d), lambda i, bi, h: (bi, i, h, 0)),
            pl.BlockSpec((None, nk_pad, None, d), lambda i, bi, h: (bi, 0, h // kv_group, 0)),
            pl.BlockSpec((None, nk_pad, None, d), lambda i, bi, h: (bi, 0, h // kv_group, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, block_q, None, d), lambda i, bi, h: (bi, i, h, 0)),
            pl.BlockSpec((None, None, block_q), lambda i, bi, h: (bi, h, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, nq_pad, hq, d), q.dtype),
                   jax.ShapeDtypeStruct((b, hq, nq_pad), jnp.float32)],
        compiler_params=c.compiler_params(d, num_warps, num_stages if num_stages is not None else c.fitting_stages(
            NUM_STAGES, rows=block_kv, head_dim=d, dtype=k.dtype)),
        interpret=interpret,
        name="block_sparse_attention",
    )(kv_len[:, None], counts[..., None], indices, q, k, v)
    return o[:, :nq], lse[:, :, :nq]


def _check(q, k, v, kv_block_indices, kv_block_counts, block_q, block_kv, kv_len):
    b, nq, nk, hq, hkv, d = c.check_qkv(q, k, v)
    c.check_block("block_q", block_q)
    c.check_block("block_kv", block_kv)
    indices, counts = c.check_index_lists(
        kv_block_indices, kv_block_counts, name="kv_block", lead=(b, c.cdiv(nq, block_q)),
        heads=(hq, hkv), limit=c.cdiv(nk, block_kv))
    return indices, counts, c.kv_lengths(kv_len, b, nk), d


def block_sparse_attention(q, k, v, kv_block_indices, kv_block_counts, *, block_q, block_kv, scale=None,
                           kv_len=None, return_lse=False, interpret=False, num_warps=None, num_stages=None,
                           preload_indices=None, backend="auto", stages=None):
    """Attention of each query block over its listed key blocks only.

    Args:
      q: [B, Nq, Hq, D]; k, v: [B, Nk, Hkv, D] (GQA: Hq % Hkv == 0); Nq and Nk need not be multiples
        of the blocks (tails are padded and masked).
      kv_block_indices, kv_block_counts: see the module docstring.
      block_q, block_kv: the pattern's block sizes, powers of two >= 16 (32, 64, 128 typical).
      scale: default 1/sqrt(D). kv_len: None, int or int [B]; keys at or beyond it are ignored
        (their values zeroed at tile load: NaN or Inf there cannot leak).
      return_lse: also return the natural-log LSE f32 [B, Hq, Nq].
      num_warps, num_stages: Triton tuning; default 8 warps (4 for D <= 64) and 3 stages.
      preload_indices: read each index row into registers once instead of one index per step
        (measured 5-20% faster at 128-blocks on H200); default: when the padded row has at most
        PRELOAD_MAX_WIDTH entries, since picking an entry costs a reduction over the row.
      backend: "auto" (the Mosaic GPU kernel on Hopper for bf16/f16, head_dim a multiple of 64,
        block_q = 128 and block_kv 64 or 128, unless a Triton knob or interpret is given; Triton
        otherwise), "mosaic" or "triton". The Mosaic loader reads the index row one entry per step
        and TMA-loads exactly the listed tiles.
      stages: the Mosaic kernel's K/V ring depth (default `mosaic.default_tiling`).

    Returns o [B, Nq, Hq, D] in q.dtype, or (o, lse).
    """
    scale = c.check_scale(scale)
    indices, counts, lengths, d = _check(q, k, v, kv_block_indices, kv_block_counts, block_q, block_kv,
                                         kv_len)
    scale = c.resolve_scale(scale, d)
    knobs = any(x is not None for x in (num_warps, num_stages, preload_indices))
    which = mosaic.choose(backend, q, scale=scale, interpret=interpret, triton_knobs=knobs,
                          name="block_sparse_attention", block_q=block_q, block_kv=block_kv)
    if which == "mosaic":
        o, lse = mosaic.block_sparse(q, k, v, indices, counts, lengths, scale=scale, block_q=block_q,
                                     block_kv=block_kv, has_kv_len=kv_len is not None, stages=stages)
        return (o, lse) if return_lse else o
    masked = kv_len is not None or k.shape[1] % block_kv != 0
    if preload_indices is None:
        preload_indices = c.next_pow2(indices.shape[-1]) <= PRELOAD_MAX_WIDTH
    o, lse = _block_sparse(q, k, v, indices, counts, lengths, scale=scale,
                           block_q=block_q, block_kv=block_kv, masked=masked, preload=preload_indices, num_warps=num_warps,
                           num_stages=num_stages, interpret=interpret)
    return (o, lse) if return_lse else o


def block_mask(kv_block_indices, kv_block_counts, *, block_q, block_kv, num_queries, num_keys, num_heads):
    """The boolean [B, Hq, Nq, Nk] mask that the index lists describe (for references and analysis)."""
    n_kb = c.cdiv(num_keys, block_kv)
    width = kv_block_indices.shape[-1]
    live = jnp.arange(width) < kv_block_counts[..., None]
    blocks = jnp.any(jax.nn.one_hot(kv_block_indices, n_kb, dtype=bool) & live[..., None], axis=3)
    blocks = jnp.repeat(blocks, num_heads // blocks.shape[1], axis=1)
    rows = jnp.repeat(blocks, block_q, axis=2)[:, :, :num_queries]
    return jnp.repeat(rows, block_kv, axis=3)[..., :num_keys]


def block_sparse_attention_reference(q, k, v, kv_block_indices, kv_block_counts, *, block_q, block_kv,
                                     scale=None, kv_len=None, return_lse=False, interpret=False,
                                     num_warps=None, num_stages=None, preload_indices=False, backend="auto",
                                     stages=None):
    """The same function as `block_sparse_attention`, computed densely in fp32 jnp."""
    scale = c.check_scale(scale)
    del interpret, num_warps, num_stages, preload_indices, backend, stages
    indices, counts, lengths, d = _check(q, k, v, kv_block_indices, kv_block_counts, block_q, block_kv,
                                         kv_len)
    nq, nk, hq = q.shape[1], k.shape[1], q.shape[2]
    allowed = block_mask(indices, counts, block_q=block_q, block_kv=block_kv, num_queries=nq,
                         num_keys=nk, num_heads=hq)
    allowed &= (jnp.arange(nk)[None, :] < lengths[:, None])[:, None, None, :]
    o, lse = c.dense_reference(q, k, v, allowed, c.resolve_scale(scale, d))
    return (o, lse) if return_lse else o
