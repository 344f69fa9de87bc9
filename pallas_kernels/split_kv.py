"""Split-KV ("flash-decoding") attention for block diffusion: a block of a few queries (4-64) against
a long KV cache, dense or over a gathered per-KV-head index list.

One block of queries gives too few query tiles to fill the GPU, so the key axis is split across
programs instead. Grid (splits, batch, KV heads): each program takes the G query heads of its KV
head times the block's queries as one [G * Nq, D] tile (every K/V row it loads feeds all of them),
runs the online softmax over its share of the keys and writes an fp32 partial (o, lse); a second
kernel merges the partials by LSE and writes the queries' layout (`split_kv_combine`; its reference is
`merge.combine_partials` and the unfold in jnp). Shares are computed from the
runtime length, so a mostly empty cache still spreads its live keys over every split.

Gathered form index layout:
  kv_indices int32 [B, Hkv, max_keys]: cache positions in [0, Nk) per KV head (MAGE: the selected
      prefix keys, plus the current block's own positions if it is to be attended). Entries at or
      beyond the count are padding: loaded with the last tile (so in range) but masked out, their
      logits set to -inf and their values to 0, so NaN or Inf there cannot leak (0 * NaN = NaN). A
      position listed twice counts twice: concrete inputs are checked and raise.
  kv_counts int32 [B, Hkv]: valid entries, 0..max_keys.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels import _common as c
from pallas_kernels.merge import combine_partials

TARGET_PROGRAMS = 264  # two waves on a 132-SM H100/H200
# At least this many key tiles per split. A floor above 1 leaves a short cache's tiles in one program per (batch,
# KV head): with 8, SDAR-8B at batch 1 and a 1k prompt runs its 8 KV heads as 8 programs on a 132-SM GPU. End to
# end on an H100 (SDAR-8B batch 1, 1k prompt, 128 new tokens) a floor of 1 runs bf16 at 153.1 tok/s against 142.9
# with 8, int8 at 233.0 against 209.6 (docs/benchmarks.md): the extra fp32 partials and their merge cost less than
# the idle SMs. Long caches are capped by TARGET_PROGRAMS instead (batch 1, 8 KV heads: from 33k positions on).
MIN_TILES_PER_SPLIT = 1
MAX_BLOCK_ROWS = 256  # G * Nq query rows folded into one tile: the most the kernels take
BLOCK_KV = 128  # key tile of both kernels unless a call gives its own
NUM_STAGES = 3  # measured on H200 (benchmarks/results/attention_*): 3 stages beat 2 by ~30% here


def _share(total, num_splits: int, block_kv: int):
    """This program's [lo, hi) of `total` items, cut into `num_splits` block-aligned shares."""
    span = ((total + num_splits - 1) // num_splits + block_kv - 1) // block_kv * block_kv
    lo = pl.program_id(0) * span
    return lo, jnp.minimum(lo + span, total)


def _folded_queries(q_ref, *, queries: int, group: int, rows: int):
    """This program's KV head's queries as one [rows, D] tile, gathered from q's [Nq * Hq, D] rows (no folded copy of
    q made before the launch): row g * Nq + n is query n of head h * G + g; rows past G * Nq repeat the last head's
    (computed, never read)."""
    r = jnp.arange(rows)
    head = pl.program_id(2) * group + jnp.minimum(r // queries, group - 1)
    return q_ref[(r % queries) * (q_ref.shape[0] // queries) + head, :]


def _dense_kernel(kvlen_ref, q_ref, k_ref, v_ref, *refs, scale_log2, block_kv, num_splits, fold, store=None,
                  per_query=False, scaled=False):
    # scaled: k / v are float8 rows with one float32 scale per (position, KV head), applied in registers (`tile`)
    ks_ref, vs_ref, o_ref, lse_ref, *store_refs = refs if scaled else (None, None, *refs)
    q = _folded_queries(q_ref, **fold)
    if per_query:  # kvlen_ref holds the row's fill length per query: folded row g * Nq + n is query n
        limit = kvlen_ref[jnp.arange(fold["rows"]) % fold["queries"]]
        total, least = jnp.max(limit), jnp.min(limit)
    else:
        limit, total = None, kvlen_ref[0]
        least = total
    lo, hi = _share(total, num_splits, block_kv)
    n = jnp.maximum(hi - lo, 0)
    whole = jnp.maximum(jnp.minimum(hi, least) - lo, 0) // block_kv  # tiles every query sees whole
    capacity = k_ref.shape[0]  # >= block_kv (`_split_kv`), not necessarily a multiple of it

    def tile(j, carry, masked):
        start = pl.multiple_of(lo + j * block_kv, block_kv)
        if not masked:  # whole tiles below hi <= capacity
            valid, first = None, start
        else:  # the last tile may run past the capacity: it loads the last block_kv rows instead (in
            # bounds, no padded copy of the cache) and keeps only its positions in [start, hi)
            first = jnp.minimum(start, capacity - block_kv)
            position = first + jnp.arange(block_kv)
            valid = (position >= start) & (position < hi)
        k = k_ref[pl.ds(first, block_kv), :]
        v = v_ref[pl.ds(first, block_kv), :]
        v_scale = None
        if scaled:  # e4m3 converts exactly; a key's scale multiplies its logits' column, a value's its probabilities'
            k, v = k.astype(q.dtype), v.astype(q.dtype)
            v_scale = vs_ref[pl.ds(first, block_kv)]
            if valid is not None:  # scratch scales (NaN, Inf) must not reach a product
                v_scale = jnp.where(valid, v_scale, 0.0)
        s = c.logits(q, k, scale_log2)
        if scaled:
            s = s * ks_ref[pl.ds(first, block_kv)][None, :]
        if store == "logits":  # every key below kv_len lies in one program's share and gets its logit; a last
            # tile loaded from below its start rewrites its neighbours' columns with the same values
            store_refs[0][:, pl.ds(first, block_kv)] = s * c.LN2
        elif store == "probs":
            _store_probs(*store_refs, s, first, start // block_kv, block_kv, valid)
        if valid is None:
            return c.logits_update(carry, s, v, v_scale)
        # keys past the share hidden from every query; with a fill length per query, those below one query's and at
        # or past another's from that query
        keep = valid[None, :] if limit is None else valid[None, :] & (position[None, :] < limit[:, None])
        return c.logits_update(carry, jnp.where(keep, s, -jnp.inf), c.mask_values(v, valid), v_scale)

    carry = jax.lax.fori_loop(0, whole, functools.partial(tile, masked=False), c.init_carry(q.shape[0], q.shape[1]))
    carry = jax.lax.fori_loop(whole, (n + block_kv - 1) // block_kv, functools.partial(tile, masked=True), carry)
    o_ref[...], lse_ref[...] = c.finalize(carry)


def _store_probs(probs_ref, tile_max_ref, s, first: int, tile: int, block_kv: int, valid):
    """A tile's probabilities relative to its own maximum per row, in float16 (1 at the maximum: 11 significant
    bits of every probability, half the bytes of float32 logits), and that maximum (base 2). The columns of a last
    tile loaded from below its start belong to the tile before it, normalised by that tile's maximum: only the
    tile's own columns are written there."""
    if valid is not None:
        s = jnp.where(valid[None, :], s, -jnp.inf)
    top = jnp.max(s, axis=1)
    p = jnp.exp2(s - top[:, None]).astype(jnp.float16)
    if valid is None:
        probs_ref[:, pl.ds(first, block_kv)] = p
    else:
        plt.store(probs_ref.at[:, pl.ds(first, block_kv)], p, mask=jnp.broadcast_to(valid[None, :], p.shape))
    tile_max_ref[:, pl.ds(tile, 1)] = top[:, None]


def _gather_kernel(cnt_ref, idx_ref, q_ref, k_ref, v_ref, o_ref, lse_ref, *, scale_log2, block_kv, num_splits,
                   entries, fold):
    q = _folded_queries(q_ref, **fold)
    # traced lists are clamped here, not by an XLA op before the call: a sparse step then launches the kernel alone;
    # a count stops at the list's own entries (`entries`: the width before padding to whole tiles)
    lo, hi = _share(jnp.clip(cnt_ref[0], 0, entries), num_splits, block_kv)

    def tile(j, carry):
        start = pl.multiple_of(lo + j * block_kv, block_kv)
        cols = jnp.clip(idx_ref[pl.ds(start, block_kv)], 0, k_ref.shape[0] - 1)
        k = k_ref[cols, :]
        v = v_ref[cols, :]
        valid = start + jnp.arange(block_kv) < hi  # entries past the count are padding
        return c.tile_update(carry, q, k, v, scale_log2, valid)

    n = jnp.maximum(hi - lo, 0)
    carry = jax.lax.fori_loop(0, (n + block_kv - 1) // block_kv, tile, c.init_carry(q.shape[0], q.shape[1]))
    o_ref[...], lse_ref[...] = c.finalize(carry)


def _unfold(o, lse, shape):
    b, nq, hq, d = shape
    hkv = o.shape[1]
    o = o[:, :, : hq // hkv * nq].reshape(b, hkv, hq // hkv, nq, d).transpose(0, 3, 1, 2, 4)
    lse = lse[:, :, : hq // hkv * nq].reshape(b, hq, nq)
    return o.reshape(b, nq, hq, d), lse


# f32 values of the partials one combine program holds per step ([chunk, D] of its row): 64 registers a thread at
# 4 warps
COMBINE_VALUES = 8192


def combine_chunk(num_splits: int, head_dim: int) -> int:
    """Splits `split_kv_combine` merges per step: a power of two, at most 64 and at most COMBINE_VALUES / head_dim
    (the step's [chunk, D] partials sit in registers): SDAR-8B's 33 splits at batch 1 and 128k in one step."""
    return max(1, min(64, c.next_pow2(num_splits), COMBINE_VALUES // head_dim))


def padded_splits(num_splits: int, head_dim: int) -> int:
    """The split count the partials are allocated with: whole chunks, so every step's load stays in the array (the
    splits past num_splits are never written and never weigh)."""
    chunk = combine_chunk(num_splits, head_dim)
    return c.cdiv(num_splits, chunk) * chunk


def _combine_kernel(o_ref, lse_ref, out_ref, out_lse_ref, *, num_splits: int, chunk: int):
    # one query row of every split's partial: o [S', D], lse [S'] (S' >= S splits, the rest unwritten), merged by
    # LSE a chunk of splits at a time, as `merge.combine_partials` merges them: empty partials (lse -inf, o
    # anything) weigh nothing, an LSE of +inf or NaN makes the row NaN
    def merge(i, carry):
        m, total, acc, invalid = carry
        first = pl.multiple_of(i * chunk, chunk)
        lse = lse_ref[pl.ds(first, chunk)]
        lse = jnp.where(first + jnp.arange(chunk) < num_splits, lse, -jnp.inf)
        invalid = jnp.maximum(invalid, jnp.max(jnp.where((lse != lse) | (lse == jnp.inf), 1.0, 0.0)))  # != : NaN
        new_m = jnp.maximum(m, jnp.max(lse))
        shift = jnp.where(new_m == -jnp.inf, 0.0, new_m)
        w = jnp.exp(lse - shift)
        part = jnp.sum(jnp.where(w[:, None] > 0, w[:, None] * o_ref[pl.ds(first, chunk), :], 0.0), axis=0)
        rescale = jnp.exp(m - shift)
        return new_m, total * rescale + jnp.sum(w), acc * rescale + part, invalid

    d = out_ref.shape[-1]
    m, total, acc, invalid = jax.lax.fori_loop(
        0, c.cdiv(num_splits, chunk), merge,
        (jnp.float32(-jnp.inf), jnp.float32(0.0), jnp.zeros((d,), jnp.float32), jnp.float32(0.0)))
    empty = total == 0.0
    o = acc / jnp.where(empty, 1.0, total)
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, total)))
    out_ref[...] = jnp.where(invalid > 0, jnp.nan, o).astype(out_ref.dtype)
    out_lse_ref[...] = jnp.full((1,), jnp.where(invalid > 0, jnp.nan, lse), jnp.float32)


def split_kv_combine(o, lse, shape, dtype, *, num_splits=None, interpret=False):
    """The split-KV partials merged by LSE and unfolded to the queries' layout, in one launch: o f32 [B, Hkv, S',
    rows, D] and lse f32 [B, Hkv, S', rows] (row g * Nq + n: query n of head h * G + g; rows past G * Nq ignored;
    splits past `num_splits`, default all S', ignored: never written) -> (o [B, Nq, Hq, D] in `dtype`, lse f32 [B,
    Hq, Nq]) for q's shape [B, Nq, Hq, D]. (XLA merged and unfolded them in several small fusions per call: at
    batch 1 launches, not bytes, bound a block.) Grid (B, Hkv, G * Nq): one program per query row, merging
    `combine_chunk` splits per step, S' a multiple of it (`padded_splits`)."""
    b, nq, hq, d = shape
    hkv, allocated = o.shape[1], o.shape[2]
    num_splits = allocated if num_splits is None else num_splits
    chunk = combine_chunk(num_splits, d)
    if allocated % chunk or allocated < num_splits:
        raise ValueError(f"the partials hold {allocated} splits: need whole chunks of {chunk} covering {num_splits} "
                         f"(padded_splits({num_splits}, {d}) = {padded_splits(num_splits, d)})")
    g = hq // hkv
    out, out_lse = pl.pallas_call(
        functools.partial(_combine_kernel, num_splits=num_splits, chunk=chunk),
        grid=(b, hkv, g * nq),
        in_specs=[pl.BlockSpec((None, None, allocated, None, d), lambda bi, h, r: (bi, h, 0, r, 0)),
                  pl.BlockSpec((None, None, allocated, None), lambda bi, h, r: (bi, h, 0, r))],
        out_specs=[pl.BlockSpec((None, None, None, d), lambda bi, h, r: (bi, r % nq, h * g + r // nq, 0)),
                   pl.BlockSpec((None, None, None, 1), lambda bi, h, r: (bi, h * g + r // nq, r % nq, 0))],
        out_shape=[jax.ShapeDtypeStruct((b, nq, hq, d), dtype), jax.ShapeDtypeStruct((b, hq, nq, 1), jnp.float32)],
        compiler_params=c.compiler_params(d, 4, 2),
        interpret=interpret,
        name="split_kv_combine",
    )(o, lse)
    return out, out_lse[..., 0]


def split_kv_combine_reference(o, lse, shape, dtype, *, num_splits=None, interpret=False):
    """The same function as `split_kv_combine`, in jnp (`merge.combine_partials`, then the queries' layout)."""
    del interpret
    o, lse = combine_partials(o[:, :, :num_splits], lse[:, :, :num_splits], axis=2)
    o, lse = _unfold(o, lse, shape)
    return o.astype(dtype), lse


def _launch(kernel, lead, q, k, v, *, block_kv, num_splits, num_warps, num_stages, interpret, name, store=None,
            scales=()):
    """Runs `kernel` on (lead inputs..., q as [B, Nq * Hq, D], k, v); `lead` is a list of (BlockSpec, array).

    Each program folds its KV head's queries into one tile itself (`_folded_queries`: the kernel takes `fold`) and
    sees its (batch, KV head)'s whole cache row [Nk, D] of k and v and reads its share
    of it in place. Returns (o, lse), and with `store` the kernel's further outputs over the folded query rows (see
    `split_kv_attention`): "logits" f32 [B, Hkv, G * Nq, Nk]; "probs" f16 [B, Hkv, G * Nq, Nk] and their tiles'
    maxima f32 [B, Hkv, G * Nq, ceil(Nk / block_kv)].
    """
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    rows = max(16, c.next_pow2(nq * hq // hkv))
    kernel = functools.partial(kernel, fold=dict(queries=nq, group=hq // hkv, rows=rows))
    out_specs = [pl.BlockSpec((None, None, None, rows, d), lambda s, bi, h: (bi, h, s, 0, 0)),
                 pl.BlockSpec((None, None, None, rows), lambda s, bi, h: (bi, h, s, 0))]
    allocated = padded_splits(num_splits, d)
    out_shape = [jax.ShapeDtypeStruct((b, hkv, allocated, rows, d), jnp.float32),
                 jax.ShapeDtypeStruct((b, hkv, allocated, rows), jnp.float32)]
    if store is not None:  # every split writes its share of the (batch, KV head)'s whole row
        out_specs.append(pl.BlockSpec((None, None, rows, nk), lambda s, bi, h: (bi, h, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, hkv, rows, nk), jnp.float32 if store == "logits" else jnp.float16))
    if store == "probs":
        tiles = c.cdiv(nk, block_kv)
        out_specs.append(pl.BlockSpec((None, None, rows, tiles), lambda s, bi, h: (bi, h, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, hkv, rows, tiles), jnp.float32))
    # the stored tile [rows, block_kv] passes through shared memory on its way out (f32 logits at 128 query rows,
    # bf16 and head_dim 128: 3 stages asked 288 KiB of the H200's 227, RESOURCE_EXHAUSTED)
    reserved = rows * block_kv * {None: 0, "logits": 4, "probs": 2}[store]
    o, lse, *rest = pl.pallas_call(
        kernel,
        grid=(num_splits, b, hkv),
        in_specs=[
            *(spec for spec, _ in lead),
            pl.BlockSpec((None, nq * hq, d), lambda s, bi, h: (bi, 0, 0)),  # the row's queries, as they are
            pl.BlockSpec((None, nk, None, d), lambda s, bi, h: (bi, 0, h, 0)),
            pl.BlockSpec((None, nk, None, d), lambda s, bi, h: (bi, 0, h, 0)),
            *(pl.BlockSpec((None, nk, None), lambda s, bi, h: (bi, 0, h)) for _ in scales),  # [B, Nk, Hkv] scales
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=c.compiler_params(d, num_warps, num_stages if num_stages is not None else c.fitting_stages(
            NUM_STAGES, rows=block_kv, head_dim=d, dtype=q.dtype, reserved=reserved)),
        interpret=interpret,
        name=name,
    )(*(x for _, x in lead), q.reshape(b, nq * hq, d), k, v, *scales)
    o, lse = split_kv_combine(o, lse, q.shape, q.dtype, num_splits=num_splits, interpret=interpret)
    return (o, lse, *(x[:, :, :nq * hq // hkv] for x in rest))


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "num_splits", "num_warps", "num_stages",
                                             "interpret", "store"))
def _split_kv(q, k, v, kv_len, k_scale=None, v_scale=None, *, scale, block_kv, num_splits, num_warps, num_stages,
              interpret, store=None):
    # any capacity of at least one tile is read in place (the kernel's last tile stays in bounds); a
    # smaller cache is padded to one tile, a copy of fewer than block_kv rows
    nk = k.shape[1]
    k, v = c.pad_axis(k, 1, max(nk, block_kv)), c.pad_axis(v, 1, max(nk, block_kv))
    scales = () if k_scale is None else tuple(c.pad_axis(x, 1, max(nk, block_kv)) for x in (k_scale, v_scale))
    per_query = kv_len.ndim == 2
    kernel = functools.partial(_dense_kernel, scale_log2=scale * c.LOG2E, block_kv=block_kv,
                               num_splits=num_splits, store=store, per_query=per_query, scaled=bool(scales))
    # [B, 1] fill lengths, or [B, Nq] padded to a power of two (Triton's block shapes; the padding is never read)
    lengths = c.pad_axis(kv_len, 1, c.next_pow2(kv_len.shape[1])) if per_query else kv_len[:, None]
    lead = [(pl.BlockSpec((None, lengths.shape[1]), lambda s, bi, h: (bi, 0)), lengths)]
    out = _launch(kernel, lead, q, k, v, block_kv=block_kv, num_splits=num_splits, num_warps=num_warps,
                  num_stages=num_stages, interpret=interpret, name="split_kv_attention", store=store, scales=scales)
    if store is None:
        return out
    return (*out[:2], out[2][..., :nk], *out[3:])


@functools.partial(jax.jit, static_argnames=("scale", "block_kv", "num_splits", "num_warps", "num_stages",
                                             "interpret"))
def _split_kv_gather(q, k, v, indices, counts, *, scale, block_kv, num_splits, num_warps, num_stages, interpret):
    entries = indices.shape[-1]
    width = split_kv_gather_width(entries, block_kv)
    indices = c.pad_last_repeat(indices, width)
    kernel = functools.partial(_gather_kernel, scale_log2=scale * c.LOG2E, block_kv=block_kv,
                               num_splits=num_splits, entries=entries)
    lead = [(pl.BlockSpec((None, None, 1), lambda s, bi, h: (bi, h, 0)), counts[..., None]),
            (pl.BlockSpec((None, None, width), lambda s, bi, h: (bi, h, 0)), indices)]
    return _launch(kernel, lead, q, k, v, block_kv=block_kv, num_splits=num_splits, num_warps=num_warps,
                   num_stages=num_stages, interpret=interpret, name="split_kv_gather_attention")


def split_kv_gather_width(entries: int, block_kv: int = BLOCK_KV) -> int:
    """The width the gathered kernel reads an index list of `entries` entries at (whole key tiles): a list this
    wide is read as it is; a narrower one is padded by repeating its last entry, a copy at every call."""
    return c.cdiv(entries, block_kv) * block_kv


def default_num_splits(batch: int, kv_heads: int, keys: int, block_kv: int) -> int:
    """Enough programs for about two waves, with at least MIN_TILES_PER_SPLIT key tiles each."""
    return max(1, min(c.cdiv(TARGET_PROGRAMS, batch * kv_heads), c.cdiv(keys, block_kv) // MIN_TILES_PER_SPLIT))


def supported_block(num_queries: int, num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the split-KV kernels take a block of num_queries queries with these head counts and
    head_dim: G * Nq <= MAX_BLOCK_ROWS (G = num_heads / num_kv_heads) and a supported head_dim."""
    return num_queries * num_heads // num_kv_heads <= MAX_BLOCK_ROWS and head_dim in c.HEAD_DIMS


def _check_block_queries(q, k, block_kv, num_splits):
    b, nq, hq, d = q.shape
    hkv = k.shape[2]
    c.check_block("block_kv", block_kv)
    if nq * hq // hkv > MAX_BLOCK_ROWS:
        raise ValueError(f"split-KV attention folds G * Nq = {hq // hkv} * {nq} query rows into one tile; "
                         f"at most {MAX_BLOCK_ROWS} are supported (use flash_attention for long query blocks)")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits={num_splits!r} must be a positive int")


def split_kv_attention(q, k, v, *, kv_len=None, scale=None, return_lse=False, interpret=False, block_kv=BLOCK_KV,
                       num_splits=None, num_warps=None, num_stages=None, return_logits=False, return_probs=False,
                       k_scale=None, v_scale=None):
    """Dense attention of a short query block over a long KV cache, split along the keys.

    Args:
      q: [B, Nq, Hq, D] (a block of queries; G * Nq <= 256 with G = Hq / Hkv).
      k, v: [B, Nk, Hkv, D], e.g. one layer's static KV cache of capacity Nk (read in place).
      kv_len: None, int or int [B]: the filled length; keys at or beyond it are ignored, whatever
        they hold (the kernel zeroes their values at tile load: NaN or Inf there cannot leak). Or int
        [B, Nq]: each query's own fill length (segments of a block that see different prefixes of the
        cache, attended in one pass over it; not with return_logits / return_probs).
      scale: default 1/sqrt(D). return_lse: also return the natural-log LSE f32 [B, Hq, Nq].
      block_kv: key tile (power of two >= 16); any capacity Nk >= block_kv is read in place, a
        multiple of block_kv or not (a smaller one is padded to one tile). num_splits: programs per
        (batch, KV head) along the keys; default `default_num_splits`.
      return_logits: also return the scaled logits the pass computes, f32 [B, Hkv, G * Nq, Nk]: row g * Nq + n
        of KV head h is query n of head h * G + g, column j its logit (scale * q.k) against key j; columns at or
        beyond kv_len are unspecified. With the LSE they give every key's probabilities without reading the keys
        again (MAGE's Eq. 3 scores: `kv_scores_from_logits`).
      return_probs: instead, the same in half the bytes: (probs f16 [B, Hkv, G * Nq, Nk], tile_max f32 [B, Hkv,
        G * Nq, ceil(Nk / block_kv)]) with probs[..., r, j] = 2 ** (s[r, j] - tile_max[r, j // block_kv]), s the
        logit in base 2 (logit * log2(e)) and tile_max the largest s of its key tile below kv_len: every
        probability to 11 significant bits, 1 at its tile's maximum (`kv_scores_from_probs`). Columns at or
        beyond kv_len, and the maxima of tiles wholly beyond it, are unspecified.

      k_scale, v_scale: float32 [B, Nk, Hkv] with k and v float8_e4m3fn: a quantized cache, position j of KV
        head h holding k[:, j, h] * k_scale[:, j, h] (`dequantize`): the tiles load at one byte per element and
        convert exactly, and each key's scale multiplies its column of the logits, each value's its column of the
        probabilities (a multiply per query row and key, not per element); not with return_logits / return_probs.

    Returns o [B, Nq, Hq, D] in q.dtype, or (o, lse), then the logits or (probs, tile_max) where asked.
    """
    scale = c.check_scale(scale)
    store = _stored(return_logits, return_probs)
    k_abstract, v_abstract = check_scaled(q, k, v, k_scale, v_scale, store)
    b, nq, nk, hq, hkv, d = c.check_qkv(q, k_abstract, v_abstract)
    _check_block_queries(q, k, block_kv, num_splits)
    lengths = fill_lengths(kv_len, b, nq, nk, store)
    splits = num_splits or default_num_splits(b, hkv, nk, block_kv)
    o, lse, *stored = _split_kv(q, k, v, lengths, k_scale, v_scale, scale=c.resolve_scale(scale, d),
                                block_kv=block_kv, num_splits=splits, num_warps=num_warps, num_stages=num_stages,
                                interpret=interpret, store=store)
    return _returned(o, lse, stored, return_lse)


KV_DTYPE = jnp.dtype(jnp.float8_e4m3fn)  # the quantized cache's element type


def dequantize(x, scale, dtype):
    """Quantized rows x [B, Nk, Hkv, D] (float8) with scales [B, Nk, Hkv] as `dtype`."""
    return (x.astype(jnp.float32) * scale[..., None]).astype(dtype)


def check_scaled(q, k, v, k_scale, v_scale, store=None):
    """k and v as the dtype-checked shapes `_common.check_qkv` takes: themselves, or with scales (a float8 cache,
    `split_kv_attention`'s k_scale / v_scale) shapes of q's dtype once the scales are checked."""
    if k_scale is None and v_scale is None:
        return k, v
    if k_scale is None or v_scale is None:
        raise ValueError("k_scale and v_scale come together (a quantized cache has both)")
    if jnp.dtype(k.dtype) != KV_DTYPE or jnp.dtype(v.dtype) != KV_DTYPE:
        raise ValueError(f"k_scale / v_scale go with float8_e4m3fn k and v, got {k.dtype} and {v.dtype}")
    for name, x, of in (("k_scale", k_scale, k), ("v_scale", v_scale, v)):
        if x.shape != of.shape[:3] or jnp.dtype(x.dtype) != jnp.float32:
            raise ValueError(f"{name} must be float32 {list(of.shape[:3])} (one per position and KV head), got "
                             f"{x.dtype} {list(x.shape)}")
    if store is not None:
        raise ValueError("a quantized cache (k_scale / v_scale) does not go with return_logits / return_probs")
    return jax.ShapeDtypeStruct(k.shape, q.dtype), jax.ShapeDtypeStruct(v.shape, q.dtype)


def fill_lengths(kv_len, batch: int, num_queries: int, num_keys: int, store=None) -> jax.Array:
    """`kv_len` as int32 [B] (None, an int or [B]: `_common.kv_lengths`) or int32 [B, Nq] (one per query, checked
    and clamped alike)."""
    if kv_len is None or jnp.ndim(kv_len) < 2:
        return c.kv_lengths(kv_len, batch, num_keys)
    if jnp.shape(kv_len) != (batch, num_queries):
        raise ValueError(f"kv_len must be a scalar or shape [{batch}] or [{batch}, {num_queries}] (one per query), "
                         f"got shape {jnp.shape(kv_len)}")
    if store is not None:
        raise ValueError("kv_len per query [B, Nq] does not go with return_logits / return_probs: they keep one "
                         "fill length per row")
    rows = c.kv_lengths(jnp.reshape(kv_len, (-1,)), batch * num_queries, num_keys)
    return rows.reshape(batch, num_queries)


def _stored(return_logits, return_probs):
    if return_logits and return_probs:
        raise ValueError("return_logits and return_probs are two forms of the same thing: ask for one")
    return "logits" if return_logits else "probs" if return_probs else None


def _returned(o, lse, stored: list, return_lse: bool):
    out = (o, lse) if return_lse else (o,)
    out += tuple(stored)
    return out if len(out) > 1 else o


def split_kv_attention_reference(q, k, v, *, kv_len=None, scale=None, return_lse=False, interpret=False,
                                 block_kv=BLOCK_KV, num_splits=None, num_warps=None, num_stages=None,
                                 return_logits=False, return_probs=False, k_scale=None, v_scale=None):
    """The same function as `split_kv_attention`, computed densely in fp32 jnp (logits at or beyond kv_len: -inf;
    probabilities there 0, the maxima of tiles wholly beyond it -inf; a quantized cache dequantized first)."""
    scale = c.check_scale(scale)
    del interpret, num_warps, num_stages
    store = _stored(return_logits, return_probs)
    check_scaled(q, k, v, k_scale, v_scale, store)
    if k_scale is not None:
        # in float32, as the kernel applies the scales to the float32 logits and probabilities
        out_dtype, q = q.dtype, q.astype(jnp.float32)
        k, v = dequantize(k, k_scale, jnp.float32), dequantize(v, v_scale, jnp.float32)
    else:
        out_dtype = q.dtype
    b, nq, nk, hq, hkv, d = c.check_qkv(q, k, v)
    _check_block_queries(q, k, block_kv, num_splits)
    lengths = fill_lengths(kv_len, b, nq, nk, store)
    # [B, 1, 1 | Nq, Nk]: the row's fill length, or each query's
    allowed = jnp.arange(nk) < (lengths[:, None, None, None] if lengths.ndim == 1 else lengths[:, None, :, None])
    o, lse = c.dense_reference(q, k, v, allowed, c.resolve_scale(scale, d))
    o = o.astype(out_dtype)
    stored = []
    if store is not None:
        # row g * Nq + n of KV head h: query n of head h * G + g
        s = jnp.einsum("bnhgd,bkhd->bhgnk", q.astype(jnp.float32).reshape(b, nq, hkv, hq // hkv, d),
                       k.astype(jnp.float32), precision="highest") * c.resolve_scale(scale, d)
        logits = jnp.where(allowed, s.reshape(b, hkv, hq // hkv * nq, nk), -jnp.inf)
        stored = [logits] if store == "logits" else list(tile_probs(logits * c.LOG2E, block_kv))
    return _returned(o, lse, stored, return_lse)


def tile_probs(s, block_kv: int):
    """(probs f16, tile_max f32) of base-2 logits s [..., Nk] (-inf where ignored) by key tiles of block_kv, as
    `split_kv_attention(..., return_probs=True)` gives them."""
    nk = s.shape[-1]
    tiles = c.cdiv(nk, block_kv)
    padded = c.pad_axis(s, s.ndim - 1, tiles * block_kv, -jnp.inf)
    tile_max = jnp.max(padded.reshape(*s.shape[:-1], tiles, block_kv), axis=-1)
    shift = jnp.repeat(tile_max, block_kv, axis=-1)[..., :nk]
    probs = jnp.where(s == -jnp.inf, 0.0, jnp.exp2(s - jnp.where(shift == -jnp.inf, 0.0, shift)))
    return probs.astype(jnp.float16), tile_max


def _check_gather(q, k, v, kv_indices, kv_counts, block_kv, num_splits):
    """(the lists clamped into range, as the kernel reads them, head_dim) of valid inputs, else ValueError."""
    b, nq, nk, hq, hkv, d = c.check_qkv(q, k, v)
    _check_block_queries(q, k, block_kv, num_splits)
    if kv_indices.ndim != 3 or kv_counts.ndim != 2:
        raise ValueError(f"kv_indices must be [B, Hkv, max_keys] and kv_counts [B, Hkv]; got "
                         f"{kv_indices.shape} and {kv_counts.shape}")
    if kv_indices.shape[1] != hkv:
        raise ValueError(f"kv_indices has {kv_indices.shape[1]} heads; the gathered form takes one list per "
                         f"KV head ({hkv})")
    indices, counts = c.check_index_lists(kv_indices[:, :, None], kv_counts[:, :, None], name="kv",
                                          lead=(b, 1), heads=(hkv,), limit=nk)
    return indices[:, :, 0], counts[:, :, 0], d


def split_kv_gather_attention(q, k, v, kv_indices, kv_counts, *, scale=None, return_lse=False,
                              interpret=False, block_kv=BLOCK_KV, num_splits=None, num_warps=None, num_stages=None):
    """Attention of a short query block over the cache rows listed per KV head (MAGE's sparse step).

    Args:
      q: [B, Nq, Hq, D]; k, v: [B, Nk, Hkv, D] (one layer's cache, read in place).
      kv_indices, kv_counts: see the module docstring (one list per batch element and KV head,
        shared by the G query heads of the group and all Nq queries).
      scale, return_lse, block_kv, num_splits: as in `split_kv_attention`; the index list is split.

    Returns o [B, Nq, Hq, D] in q.dtype, or (o, lse).
    """
    scale = c.check_scale(scale)
    d = _check_gather(q, k, v, kv_indices, kv_counts, block_kv, num_splits)[2]
    # the lists as given: traced ones are clamped inside the kernel (`_gather_kernel`), with no XLA op before it
    indices, counts = kv_indices.astype(jnp.int32), kv_counts.astype(jnp.int32)
    splits = num_splits or default_num_splits(q.shape[0], k.shape[2], indices.shape[-1], block_kv)
    o, lse = _split_kv_gather(q, k, v, indices, counts, scale=c.resolve_scale(scale, d), block_kv=block_kv,
                              num_splits=splits, num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return (o, lse) if return_lse else o


def gather_mask(kv_indices, kv_counts, *, num_queries, num_keys, num_heads):
    """The boolean [B, Hq, Nq, Nk] mask that per-KV-head lists describe."""
    live = jnp.arange(kv_indices.shape[-1]) < kv_counts[..., None]
    keys = jnp.any(jax.nn.one_hot(kv_indices, num_keys, dtype=bool) & live[..., None], axis=2)
    keys = jnp.repeat(keys, num_heads // keys.shape[1], axis=1)
    return jnp.broadcast_to(keys[:, :, None, :], keys.shape[:2] + (num_queries, num_keys))


def split_kv_gather_attention_reference(q, k, v, kv_indices, kv_counts, *, scale=None, return_lse=False,
                                        interpret=False, block_kv=BLOCK_KV, num_splits=None, num_warps=None,
                                        num_stages=None):
    """The same function as `split_kv_gather_attention`, computed densely in fp32 jnp."""
    scale = c.check_scale(scale)
    del interpret, num_warps, num_stages
    indices, counts, d = _check_gather(q, k, v, kv_indices, kv_counts, block_kv, num_splits)
    allowed = gather_mask(indices, counts, num_queries=q.shape[1], num_keys=k.shape[1], num_heads=q.shape[2])
    o, lse = c.dense_reference(q, k, v, allowed, c.resolve_scale(scale, d))
    return (o, lse) if return_lse else o
