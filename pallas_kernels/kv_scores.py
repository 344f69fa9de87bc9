"""Mean softmax probability per cache key over a query block and its GQA group: MAGE's score.

  score[b, g, k] = mean over the G query heads of KV head g and the Nq block queries of P[b, h, q, k],
  P = exp(scale * q.k - lse) over the keys below kv_len, with the LSE of `split_kv_attention(...,
      return_lse=True)` (or `flash_attention`) for the same q, k, scale and kv_len.

MAGE then takes the top-k over the prefix positions (keys below the committed cache length).
Grid (key-tile groups, batch, KV heads); each program folds its G heads x Nq queries into one tile
(as split-KV attention does) and stores the column means of its key tiles. The cache is read in place
at any capacity (the last, partial tile gathers its rows): no padded copy of it. Cost: one QK^T of the
block against the cache. Peak extra memory: the output, 4 * B * Hkv * Nk bytes (8 KV heads, 128k:
4 MiB), and the folded q (tiny).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as c
from pallas_kernels.block_scores import probabilities
from pallas_kernels.split_kv import BLOCK_KV

TILES_PER_PROGRAM = 1  # the fastest of 1-16 tiles of 64 keys at 128k, batches 1 and 4, on an H200: 8% above 8 at
# batch 1 (3.37 against 3.11 TB/s), 4% at batch 4 (3.81 against 3.67) (docs/benchmarks.md)


def _fold_queries(q, num_kv_heads: int, rows: int):
    """[B, Nq, Hq, D] -> [B, Hkv, rows, D]: row g * Nq + n holds query n of head h * G + g (the
    split-KV kernels' row order, which they fold in the kernel)."""
    b, nq, hq, d = q.shape
    folded = q.reshape(b, nq, num_kv_heads, hq // num_kv_heads, d).transpose(0, 2, 3, 1, 4)
    return c.pad_axis(folded.reshape(b, num_kv_heads, -1, d), 2, rows)


def _kernel(kvlen_ref, q_ref, lse_ref, k_ref, out_ref, *, scale_log2, block_kv, num_rows, tiles_per_program):
    q = q_ref[...]
    shift = c.prob_shift(lse_ref[...])
    kv_len = kvlen_ref[0]
    num_keys = k_ref.shape[0]  # the capacity, read in place: not necessarily a multiple of block_kv
    first = pl.program_id(0) * tiles_per_program
    whole = jnp.clip(num_keys // block_kv - first, 0, tiles_per_program)
    tiles = jnp.clip(c.cdiv(num_keys, block_kv) - first, 0, tiles_per_program)

    def tile(j, carry, partial):
        start = pl.multiple_of((first + j) * block_kv, block_kv)
        if partial:  # the tile past the capacity gathers its rows, those past the last key loading the last
            # key again (in bounds; masked below, as kv_len <= num_keys)
            k = k_ref[jnp.minimum(start + jnp.arange(block_kv), num_keys - 1), :]
        else:
            k = k_ref[pl.ds(start, block_kv), :]
        s = c.logits(q, k, scale_log2)
        s = jnp.where((start + jnp.arange(block_kv) < kv_len)[None, :], s, -jnp.inf)
        out_ref[pl.ds(j * block_kv, block_kv)] = jnp.sum(jnp.exp2(s - shift[:, None]), axis=0) / num_rows
        return carry

    jax.lax.fori_loop(0, whole, functools.partial(tile, partial=False), 0)
    jax.lax.fori_loop(whole, tiles, functools.partial(tile, partial=True), 0)


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "tiles_per_program", "num_warps", "num_stages",
                                             "interpret"))
def _kv_scores(q, k, lse, kv_len, *, scale, block_kv, tiles_per_program, num_warps, num_stages, interpret):
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    span = tiles_per_program * block_kv
    n_prog = c.cdiv(nk, span)
    # any capacity of at least one tile is read in place; a smaller cache is padded to one tile (fewer than
    # block_kv rows copied), as split-KV does
    k = c.pad_axis(k, 1, max(nk, block_kv))
    rows = max(16, c.next_pow2(nq * hq // hkv))
    folded_q = _fold_queries(q, hkv, rows)
    folded_lse = _fold_queries(lse.transpose(0, 2, 1)[..., None], hkv, rows)[..., 0]
    folded_lse = jnp.where(jnp.arange(rows) < nq * hq // hkv, folded_lse, jnp.inf)  # pad rows: p = 0
    kernel = functools.partial(_kernel, scale_log2=scale * c.LOG2E, block_kv=block_kv,
                               num_rows=float(nq * hq // hkv), tiles_per_program=tiles_per_program)
    out = pl.pallas_call(
        kernel,
        grid=(n_prog, b, hkv),
        in_specs=[
            pl.BlockSpec((None, 1), lambda s, bi, h: (bi, 0)),
            pl.BlockSpec((None, None, rows, d), lambda s, bi, h: (bi, h, 0, 0)),
            pl.BlockSpec((None, None, rows), lambda s, bi, h: (bi, h, 0)),
            pl.BlockSpec((None, k.shape[1], None, d), lambda s, bi, h: (bi, 0, h, 0)),  # the whole cache row
        ],
        out_specs=pl.BlockSpec((None, None, span), lambda s, bi, h: (bi, h, s)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, n_prog * span), jnp.float32),
        compiler_params=c.compiler_params(d, num_warps, num_stages),
        interpret=interpret,
        name="kv_scores",
    )(kv_len[:, None], folded_q, folded_lse, k)
    return out[..., :nk]


def _check(q, k, lse, block_kv, tiles_per_program, kv_len):
    b, nq, nk, hq, hkv, d = c.check_qkv(q, k, k)
    c.check_block("block_kv", block_kv)
    if not isinstance(tiles_per_program, int) or tiles_per_program < 1:
        raise ValueError(f"tiles_per_program={tiles_per_program!r} must be a positive int")
    if nq * hq // hkv > 256:
        raise ValueError(f"kv_scores folds G * Nq = {hq // hkv} * {nq} query rows into one tile; at most 256")
    if lse.shape != (b, hq, nq) or lse.dtype != jnp.float32:
        raise ValueError(f"lse must be float32 [B, Hq, Nq] = {(b, hq, nq)}, got {lse.dtype} {lse.shape}")
    return c.kv_lengths(kv_len, b, nk), d


def kv_scores(q, k, lse, *, scale=None, kv_len=None, interpret=False, block_kv=64,
              tiles_per_program=TILES_PER_PROGRAM, num_warps=None, num_stages=None):
    """Mean softmax probability per cache key over the block's queries and GQA group.

    Args:
      q: [B, Nq, Hq, D] (a block; G * Nq <= 256); k: [B, Nk, Hkv, D] (a layer's cache, read in place at any
        capacity Nk); lse: f32 [B, Hq, Nq].
      scale: default 1/sqrt(D). kv_len: None, int or int [B] (keys beyond it score 0).
      block_kv, tiles_per_program: each program scores tiles_per_program tiles of block_kv keys.

    Returns f32 [B, Hkv, Nk].
    """
    scale = c.check_scale(scale)
    lengths, d = _check(q, k, lse, block_kv, tiles_per_program, kv_len)
    return _kv_scores(q, k, lse, lengths, scale=c.resolve_scale(scale, d), block_kv=block_kv,
                      tiles_per_program=tiles_per_program, num_warps=num_warps, num_stages=num_stages,
                      interpret=interpret)


FROM_LOGITS_SPAN = 1024  # keys per program of `kv_scores_from_logits` (at most; a power of two)


def _from_logits_kernel(kvlen_ref, shift_ref, logits_ref, out_ref, *, span, num_rows):
    num_keys = logits_ref.shape[1]  # any width >= span: the last program loads the last span columns instead
    start = pl.program_id(0) * span
    first = jnp.minimum(start, num_keys - span)
    valid = first + jnp.arange(span) < kvlen_ref[0]

    def row(r, total):  # one folded query row at a time: the row count need not be a power of two
        p = jnp.exp(logits_ref[r, pl.ds(first, span)] - shift_ref[r])
        return total + jnp.where(valid, p, 0.0)  # a select: unwritten logits past kv_len may hold NaN

    total = jax.lax.fori_loop(0, num_rows, row, jnp.zeros((span,), jnp.float32))
    out_ref[pl.ds(first, span)] = total / num_rows  # a last program overlapping its neighbour writes its values


def _row_reduction(kernel, name: str, kv_len, shift, rows_of, *per_row, num_warps, interpret):
    """The scores f32 [B, Hkv, Nk] by `kernel`(kvlen_ref, shift_ref, rows_of_ref, *per_row_refs, out_ref, *, span,
    num_rows) over the folded rows a split-KV pass stored, `rows_of` [B, Hkv, rows, Nk], and arrays of per-row
    values beside them ([B, Hkv, rows, any]), each (batch, KV head)'s whole row read in place. Grid (key spans of
    up to FROM_LOGITS_SPAN, batch, KV heads)."""
    b, hkv, rows, nk = rows_of.shape
    span = min(FROM_LOGITS_SPAN, 1 << (nk.bit_length() - 1))  # the largest power of two <= Nk
    whole_rows = [pl.BlockSpec((None, None, rows, x.shape[-1]), lambda s, bi, h: (bi, h, 0, 0))
                  for x in (rows_of, *per_row)]
    return pl.pallas_call(
        functools.partial(kernel, span=span, num_rows=rows),
        grid=(c.cdiv(nk, span), b, hkv),
        in_specs=[pl.BlockSpec((None, 1), lambda s, bi, h: (bi, 0)),
                  pl.BlockSpec((None, None, rows), lambda s, bi, h: (bi, h, 0)), *whole_rows],
        out_specs=pl.BlockSpec((None, None, nk), lambda s, bi, h: (bi, h, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, nk), jnp.float32),
        compiler_params=c.compiler_params(64, num_warps, 1),
        interpret=interpret,
        name=name,
    )(kv_len[:, None], shift, rows_of, *per_row)


@functools.partial(jax.jit, static_argnames=("num_warps", "interpret"))
def _kv_scores_from_logits(logits, shift, kv_len, *, num_warps, interpret):
    return _row_reduction(_from_logits_kernel, "kv_scores_from_logits", kv_len, shift, logits, num_warps=num_warps,
                          interpret=interpret)


def _folded_lse(lse, rows_of):
    """lse f32 [B, Hq, Nq] as [B, Hkv, G * Nq]: row g * Nq + n is head h * G + g, query n, as the folded rows of
    `rows_of` [B, Hkv, G * Nq, Nk] (the logits or probabilities a split-KV pass wrote)."""
    b, hkv, rows, _ = rows_of.shape
    if lse.ndim != 3 or lse.shape[0] != b or lse.shape[1] % hkv or lse.shape[1] // hkv * lse.shape[2] != rows:
        raise ValueError(f"lse must be [B, Hq, Nq] with (Hq / Hkv) * Nq = {rows} folded rows for "
                         f"{tuple(rows_of.shape)}, got {lse.shape}")
    return lse.reshape(b, hkv, rows)


def _check_logits(logits, lse, kv_len):
    b, hkv, rows, nk = logits.shape
    if logits.dtype != jnp.float32:
        raise ValueError(f"logits must be float32 [B, Hkv, G * Nq, Nk], got {logits.dtype} {logits.shape}")
    folded = _folded_lse(lse, logits)  # a row without keys contributes 0, not NaN
    return jnp.where(folded == -jnp.inf, jnp.inf, folded), c.kv_lengths(kv_len, b, nk)


def kv_scores_from_logits(logits, lse, *, kv_len=None, interpret=False, num_warps=None):
    """`kv_scores` from the logits a split-KV pass already computed (`split_kv_attention(...,
    return_logits=True)`: f32 [B, Hkv, G * Nq, Nk], its folded query rows) and their LSE f32 [B, Hq, Nq], without
    reading the keys again: 4 * G * Nq bytes per key instead of the key's 2 * D (bf16). kv_len: None, int or int
    [B]; keys at or beyond it score 0 (the logits there are unspecified, NaN included). Grid (key spans, batch,
    KV heads): each program sums its span of up to FROM_LOGITS_SPAN keys over the rows, one row at a time. (XLA's
    own fusion of the same jnp, `kv_scores_from_logits_reference`, reads the logits at ~0.5-1.1 TB/s in MAGE's loop on
    an H200.) Returns f32 [B, Hkv, Nk]."""
    shift, lengths = _check_logits(logits, lse, kv_len)
    return _kv_scores_from_logits(logits, shift, lengths, num_warps=num_warps, interpret=interpret)


def kv_scores_from_logits_reference(logits, lse, *, kv_len=None, interpret=False, num_warps=None):
    """The same function as `kv_scores_from_logits`, in jnp."""
    del interpret, num_warps
    shift, lengths = _check_logits(logits, lse, kv_len)
    scores = jnp.mean(jnp.exp(logits - shift[..., None]), axis=2)
    return jnp.where(jnp.arange(logits.shape[-1]) < lengths[:, None, None], scores, 0.0)


def _from_probs_kernel(kvlen_ref, shift_ref, probs_ref, tile_max_ref, out_ref, *, span, num_rows, block_kv):
    num_keys = probs_ref.shape[1]  # as `_from_logits_kernel`: the last program loads the last span columns
    first = jnp.minimum(pl.program_id(0) * span, num_keys - span)
    columns = first + jnp.arange(span)
    valid = columns < kvlen_ref[0]
    tiles = columns // block_kv  # each column's tile, whose maximum its probability is relative to

    def row(r, total):
        p = probs_ref[r, pl.ds(first, span)].astype(jnp.float32) * jnp.exp2(tile_max_ref[r, tiles] - shift_ref[r])
        return total + jnp.where(valid, p, 0.0)  # a select: probabilities past kv_len are unspecified

    total = jax.lax.fori_loop(0, num_rows, row, jnp.zeros((span,), jnp.float32))
    out_ref[pl.ds(first, span)] = total / num_rows


@functools.partial(jax.jit, static_argnames=("block_kv", "num_warps", "interpret"))
def _kv_scores_from_probs(probs, tile_max, shift, kv_len, *, block_kv, num_warps, interpret):
    return _row_reduction(functools.partial(_from_probs_kernel, block_kv=block_kv), "kv_scores_from_probs", kv_len,
                          shift, probs, tile_max, num_warps=num_warps, interpret=interpret)


def _check_probs(probs, tile_max, lse, kv_len, block_kv):
    """(the base-2 shift per folded row, the lengths [B]) of `kv_scores_from_probs`' inputs, or ValueError."""
    c.check_block("block_kv", block_kv)
    b, hkv, rows, nk = probs.shape
    if probs.dtype != jnp.float16 or tile_max.dtype != jnp.float32:
        raise ValueError(f"probs must be float16 and tile_max float32, got {probs.dtype} and {tile_max.dtype}")
    tiles = (b, hkv, rows, c.cdiv(nk, block_kv))
    if tile_max.shape != tiles:
        raise ValueError(f"tile_max must be [B, Hkv, G * Nq, ceil(Nk / block_kv)] = {tiles} for probs {probs.shape} "
                         f"and block_kv={block_kv}, got {tile_max.shape}")
    return c.prob_shift(_folded_lse(lse, probs)), c.kv_lengths(kv_len, b, nk)


def kv_scores_from_probs(probs, tile_max, lse, *, kv_len=None, block_kv=BLOCK_KV, interpret=False, num_warps=None):
    """`kv_scores_from_logits` from the float16 form a split-KV pass writes with `return_probs=True`: probs f16
    [B, Hkv, G * Nq, Nk] relative to their key tile's maximum, tile_max f32 [B, Hkv, G * Nq, ceil(Nk / block_kv)]
    (base 2), and the LSE f32 [B, Hq, Nq]: 2 bytes per key and row read instead of 4. kv_len: None, int or int [B];
    keys at or beyond it score 0. The scores agree with the float32 logits' to float16's rounding of each
    probability (2**-11 relative where it is at least 2**-14 of its tile's maximum, 2**-24 of that maximum absolute
    below). Returns f32 [B, Hkv, Nk]."""
    shift, lengths = _check_probs(probs, tile_max, lse, kv_len, block_kv)
    return _kv_scores_from_probs(probs, tile_max, shift, lengths, block_kv=block_kv, num_warps=num_warps,
                                 interpret=interpret)


def kv_scores_from_probs_reference(probs, tile_max, lse, *, kv_len=None, block_kv=BLOCK_KV, interpret=False,
                                   num_warps=None):
    """The same function as `kv_scores_from_probs`, in jnp."""
    del interpret, num_warps
    shift, lengths = _check_probs(probs, tile_max, lse, kv_len, block_kv)
    nk = probs.shape[-1]
    scale = jnp.exp2(jnp.repeat(tile_max, block_kv, axis=-1)[..., :nk] - shift[..., None])
    valid = jnp.arange(nk) < lengths[:, None, None, None]
    return jnp.mean(jnp.where(valid, probs.astype(jnp.float32) * scale, 0.0), axis=2)


def kv_scores_reference(q, k, lse, *, scale=None, kv_len=None, interpret=False, block_kv=64,
                        tiles_per_program=TILES_PER_PROGRAM, num_warps=None, num_stages=None):
    """The same function as `kv_scores`, from the dense probability matrix."""
    scale = c.check_scale(scale)
    del interpret, num_warps, num_stages
    lengths, d = _check(q, k, lse, block_kv, tiles_per_program, kv_len)
    p = probabilities(q, k, lse, lengths, c.resolve_scale(scale, d))  # [B, Hq, Nq, Nk]
    b, hq, nq, nk = p.shape
    hkv = k.shape[2]
    return p.reshape(b, hkv, hq // hkv * nq, nk).mean(axis=2)
