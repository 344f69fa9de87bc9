"""Dense bidirectional flash attention with an optional key length and an optional LSE output.

Grid (query tiles, batch, query heads); K/V are read from the [B, N, H, D] layout in place (GQA is
only pointer arithmetic). Each program walks the full key tiles below `kv_len` without masks and
then at most one masked tail tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as c
from pallas_kernels import mosaic


def _kernel(kvlen_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale_log2, block_kv):
    q = q_ref[...]
    kv_len = kvlen_ref[0]
    n_full = kv_len // block_kv

    def tile(j, carry, masked):
        start = pl.multiple_of(j * block_kv, block_kv)
        k = k_ref[pl.ds(start, block_kv), :]
        v = v_ref[pl.ds(start, block_kv), :]
        valid = start + jnp.arange(block_kv) < kv_len if masked else None
        return c.tile_update(carry, q, k, v, scale_log2, valid)

    carry = jax.lax.fori_loop(0, n_full, functools.partial(tile, masked=False),
                              c.init_carry(q.shape[0], q.shape[1]))
    carry = jax.lax.fori_loop(n_full, (kv_len + block_kv - 1) // block_kv,
                              functools.partial(tile, masked=True), carry)
    o, lse = c.finalize(carry)
    o_ref[...] = o.astype(o_ref.dtype)
    lse_ref[...] = lse


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "block_kv", "num_warps", "num_stages",
                                             "interpret"))
def _flash(q, k, v, kv_len, *, scale, block_q, block_kv, num_warps, num_stages, interpret):
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    nq_pad, nk_pad = c.cdiv(nq, block_q) * block_q, c.cdiv(nk, block_kv) * block_kv
    q = c.pad_axis(q, 1, nq_pad)
    k, v = c.pad_axis(k, 1, nk_pad), c.pad_axis(v, 1, nk_pad)
    group = hq // hkv
    kernel = functools.partial(_kernel, scale_log2=scale * c.LOG2E, block_kv=block_kv)
    o, lse = pl.pallas_call(
        kernel,
        grid=(nq_pad // block_q, b, hq),
        in_specs=[
            pl.BlockSpec((None, 1), lambda i, bi, h: (bi, 0)),
            pl.BlockSpec((None, block_q, None, d), lambda i, bi, h: (bi, i, h, 0)),
            pl.BlockSpec((None, nk_pad, None, d), lambda i, bi, h: (bi, 0, h // group, 0)),
            pl.BlockSpec((None, nk_pad, None, d), lambda i, bi, h: (bi, 0, h // group, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, block_q, None, d), lambda i, bi, h: (bi, i, h, 0)),
            pl.BlockSpec((None, None, block_q), lambda i, bi, h: (bi, h, i)),
        ],
        out_shape=[jax.ShapeDtypeStruct((b, nq_pad, hq, d), q.dtype),
                   jax.ShapeDtypeStruct((b, hq, nq_pad), jnp.float32)],
        compiler_params=c.compiler_params(d, num_warps, num_stages if num_stages is not None else c.fitting_stages(
            3, rows=block_kv, head_dim=d, dtype=k.dtype)),
        interpret=interpret,
        name="flash_attention",
    )(kv_len[:, None], q, k, v)
    return o[:, :nq], lse[:, :, :nq]


def default_blocks(nq: int, nk: int) -> tuple[int, int]:
    """Tile sizes measured best on H200 for 4k-64k (128 x 128, 8 warps, 3 stages; see
    benchmarks/results/attention_*); smaller for short inputs."""
    return min(128, max(16, c.next_pow2(nq))), min(128, max(16, c.next_pow2(nk)))


def flash_attention(q, k, v, *, scale=None, kv_len=None, return_lse=False, interpret=False,
                    block_q=None, block_kv=None, num_warps=None, num_stages=None, backend="auto", tiling=None):
    """Dense bidirectional attention.

    Args:
      q: [B, Nq, Hq, D]; k, v: [B, Nk, Hkv, D] with Hq % Hkv == 0; bf16, f16 or f32; D a power of
        two in 16..256.
      scale: logit scale, default 1/sqrt(D).
      kv_len: None, an int or int [B]: keys at or beyond it are ignored, whatever K and V hold
        there (values are zeroed at tile load, so NaN or Inf cannot leak). Rows with kv_len 0 give
        o = 0 and lse = -inf.
      return_lse: also return the natural-log LSE, f32 [B, Hq, Nq].
      block_q, block_kv, num_warps, num_stages: Triton tiling (powers of two >= 16); defaults are tuned.
      backend: "auto" (the Mosaic GPU kernel on Hopper for bf16/f16, head_dim a multiple of 64 and at
        least 128 queries, unless a Triton knob or interpret is given; Triton otherwise), "mosaic"
        or "triton".
      tiling: `mosaic.Tiling` for the Mosaic kernel (default `mosaic.default_tiling`).

    Returns o [B, Nq, Hq, D] in q.dtype, or (o, lse).
    """
    scale = c.check_scale(scale)
    b, nq, nk, hq, hkv, d = c.check_qkv(q, k, v)
    scale = c.resolve_scale(scale, d)
    knobs = any(x is not None for x in (block_q, block_kv, num_warps, num_stages))
    if tiling is not None and backend == "triton":
        raise ValueError("flash_attention: `tiling` configures the Mosaic kernel; backend='triton' takes "
                         "block_q / block_kv / num_warps / num_stages")
    which = mosaic.choose(backend if tiling is None else ("mosaic" if backend == "auto" else backend), q,
                          scale=scale, interpret=interpret, triton_knobs=knobs, name="flash_attention")
    lengths = c.kv_lengths(kv_len, b, nk)
    if which == "mosaic":
        o, lse, _ = mosaic.attention(q, k, v, lengths, scale=scale, has_kv_len=kv_len is not None, tiling=tiling)
        return (o, lse) if return_lse else o
    dq, dk = default_blocks(nq, nk)
    block_q, block_kv = block_q or dq, block_kv or dk
    c.check_block("block_q", block_q)
    c.check_block("block_kv", block_kv)
    o, lse = _flash(q, k, v, lengths, scale=scale, block_q=block_q,
                    block_kv=block_kv, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return (o, lse) if return_lse else o


def flash_attention_reference(q, k, v, *, scale=None, kv_len=None, return_lse=False, interpret=False,
                              block_q=None, block_kv=None, num_warps=None, num_stages=None, backend="auto",
                              tiling=None):
    """The same function as `flash_attention`, computed densely in fp32 jnp."""
    scale = c.check_scale(scale)
    del interpret, block_q, block_kv, num_warps, num_stages, backend, tiling
    b, nq, nk, hq, hkv, d = c.check_qkv(q, k, v)
    lengths = c.kv_lengths(kv_len, b, nk)
    allowed = (jnp.arange(nk)[None, :] < lengths[:, None])[:, None, None, :]
    o, lse = c.dense_reference(q, k, v, allowed, c.resolve_scale(scale, d))
    return (o, lse) if return_lse else o
