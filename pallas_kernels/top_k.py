"""The positions of the k largest entries of each long row, ascending: MAGE's selection without a sort.

  top_k_positions(scores, k) == jnp.sort(lax.top_k(keys(scores), k)[1])

with `keys` the float32 values' IEEE total order as int32 (-0.0 below 0.0; ties go to the lower position, as in
`lax.top_k`). XLA:GPU finds a top k by sorting: at 128k keys and k = 512 MAGE's tile tournament takes six sorts per
layer, each launched after a device copy of its operand (208 sort and ~207 copy launches per output block, 3.0 ms
of GPU time at batch 1 on an H200). Here two kernels, one program per row each, and no sort:

1. `_bound_kernel`: T = the r-th largest of the row's tile maxima (tiles of `tile` keys, the maxima made by XLA
   beside the scores; r = max_held / tile >= k). At least r keys are >= T (r tiles reach it), so the k-th largest
   key is >= T; and the keys above T lie in the at most r - 1 tiles whose maximum is above T, so fewer than
   max_held of them. One pass over the row lists those keys and their positions, in position order, and counts them.
2. `_positions_kernel`: where k or more keys lie above T (the usual case: r is well above k), the top k are all
   listed: the k-th largest of the list, then the listed keys above it and the lowest-positioned ties that complete
   k, their positions written in order by a running count (no sort). Otherwise the k-th largest is T itself, and one
   more pass over the row takes every key above it and its lowest-positioned ties the same way.

Both k-th largest searches are a bisection over the 32 bits of the int32 key (32 counts over values held in
registers: at most max_held of them). The rows are read in chunks of CHUNK keys (a last, partial chunk gathers its
keys, the ones past the row loading its last key again and then masked): any row length, read in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _common as c

CHUNK = 16384  # keys per step of a pass over a row (a power of two; 4096 and 16384 within 10% at 128k)
MAX_HELD = 16384  # the most tile maxima (or keys above the bound) a program ranks in registers
MIN_TILE = 8  # keys per tile where the maxima fit (the tournament's tile; more tiles mean a tighter bound)
NUM_WARPS = 16  # the fastest of 4, 8 and 16 at 128k on an H200, 4 about twice as slow (docs/benchmarks.md)
NUM_STAGES = 1
INT_MIN = -(2 ** 31)


def keys_of(scores):
    """int32 keys in the IEEE total order of float32 `scores` (signed comparison of the keys is the values')."""
    bits = jax.lax.bitcast_convert_type(scores, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)  # negatives: larger magnitude, lower key


def tile_for(length: int, k: int, max_held: int = MAX_HELD) -> int:
    """Keys per tile of a row of `length`: the smallest power of two >= MIN_TILE whose maxima (and the keys above
    the bound, fewer than tile * k) fit in `max_held`. ValueError where none does."""
    tile = MIN_TILE
    while c.next_pow2(c.cdiv(length, tile)) > max_held:
        tile *= 2
    if tile * k > max_held:
        raise ValueError(f"top_k_positions ranks at most {max_held} keys above its bound in registers: k={k} over "
                         f"rows of {length} (tiles of {tile}) would need {tile * k}; use a smaller k")
    return tile


def _kth_largest(keys, valid, k):
    """int32 scalar: the k-th largest of `keys` where `valid` (at least k of them valid), bit by bit from the top:
    the largest t with k keys >= t, searched as t's unsigned form (t ^ INT_MIN) so that bits are set in order."""
    def step(i, u):
        candidate = u | jnp.left_shift(jnp.int32(1), 31 - i)
        count = jnp.sum(jnp.where(valid & (keys >= (candidate ^ INT_MIN)), 1, 0))
        return jnp.where(count >= k, candidate, u)

    return jax.lax.fori_loop(0, 32, step, jnp.int32(0)) ^ INT_MIN


def _row_chunk(scores_ref, start, length: int, chunk: int, partial: bool):
    """(positions, keys, in_row) of the `chunk` keys from `start`."""
    positions = start + jnp.arange(chunk)
    if partial:  # past the row: its last key again, masked by in_row
        values = scores_ref[jnp.minimum(positions, length - 1)]
    else:
        values = scores_ref[pl.ds(pl.multiple_of(start, chunk), chunk)]
    return positions, keys_of(values), positions < length


def _over_row(scores_ref, length: int, chunk: int, body, carry):
    """`body(positions, keys, in_row, carry) -> carry` over the row's chunks in order (whole ones, then the last)."""
    whole = length // chunk

    def step(j, carry, partial):
        return body(*_row_chunk(scores_ref, j * chunk, length, chunk, partial), carry)

    if whole:  # (a row shorter than a chunk has none: its slice would not fit)
        carry = jax.lax.fori_loop(0, whole, functools.partial(step, partial=False), carry)
    if length % chunk:
        carry = step(whole, carry, partial=True)
    return carry


def _bound_kernel(maxima_ref, scores_ref, keys_ref, positions_ref, info_ref, *, rank: int, length: int,
                  chunk: int):
    maxima = maxima_ref[...]  # padded with INT_MIN, which never exceeds a bound
    bound = _kth_largest(maxima, jnp.ones(maxima.shape, jnp.bool_), rank)
    held = keys_ref.shape[0] - 1  # and a last slot that the chunk's other keys are written to

    def body(positions, keys, in_row, count):
        above = in_row & (keys > bound)
        slot = count + jnp.cumsum(above.astype(jnp.int32)) - 1
        slot = jnp.where(above & (slot < held), slot, held)
        keys_ref[slot] = keys
        positions_ref[slot] = positions
        return count + jnp.sum(above.astype(jnp.int32))

    count = _over_row(scores_ref, length, chunk, body, jnp.int32(0))
    info_ref[...] = jnp.where(jnp.arange(2) == 0, bound, count)


def _take(out_ref, kth, room, k: int, positions, keys, valid, carry):
    """Writes the positions of the keys above `kth`, and of the first `room` equal to it, after the `carry` (taken,
    ties) already seen: the top k's next positions, in order. Returns the carry."""
    taken_before, ties_before = carry
    ties = valid & (keys == kth)
    tie_rank = ties_before + jnp.cumsum(ties.astype(jnp.int32)) - 1
    taken = (valid & (keys > kth)) | (ties & (tie_rank < room))
    slot = taken_before + jnp.cumsum(taken.astype(jnp.int32)) - 1
    out_ref[jnp.where(taken & (slot < k), slot, k)] = positions  # slot k: the other positions
    return taken_before + jnp.sum(taken.astype(jnp.int32)), ties_before + jnp.sum(ties.astype(jnp.int32))


def _positions_kernel(info_ref, keys_ref, positions_ref, scores_ref, out_ref, *, k: int, length: int, chunk: int):
    bound, count = info_ref[0], info_ref[1]
    held = keys_ref.shape[0] - 1
    start = (jnp.int32(0), jnp.int32(0))

    @pl.when(count >= k)
    def _from_the_list():  # the k-th largest key lies above the bound: every key of the top k is listed
        keys = keys_ref[pl.ds(0, held)]
        listed = jnp.arange(held) < count  # past the count: never written
        kth = _kth_largest(keys, listed, k)
        room = k - jnp.sum(jnp.where(listed & (keys > kth), 1, 0))
        _take(out_ref, kth, room, k, positions_ref[pl.ds(0, held)], keys, listed, start)

    @pl.when(count < k)
    def _from_the_row():  # the k-th largest is the bound: its ties (not listed) are read off the row with the rest
        _over_row(scores_ref, length, chunk, functools.partial(_take, out_ref, bound, k - count, k), start)


@functools.partial(jax.jit, static_argnames=("k", "chunk", "max_held", "num_warps", "num_stages", "interpret"))
def _top_k_positions(scores, *, k, chunk, max_held, num_warps, num_stages, interpret):
    lead, length = scores.shape[:-1], scores.shape[-1]
    rows = scores.reshape(-1, length)
    r = rows.shape[0]
    tile = tile_for(length, k, max_held)
    tiles = c.cdiv(length, tile)
    maxima = jnp.max(c.pad_axis(keys_of(rows), 1, tiles * tile, INT_MIN).reshape(r, tiles, tile), axis=-1)
    maxima = c.pad_axis(maxima, 1, c.next_pow2(tiles), INT_MIN)
    # the bound: the rank-th largest maximum, rank >= k as large as the list allows (fewer than tile * rank keys lie
    # above it), so that the k-th largest key lies above it and the row is read once more only where ties decide
    rank = max_held // tile
    params = c.compiler_params(64, num_warps if num_warps is not None else NUM_WARPS,
                               num_stages if num_stages is not None else NUM_STAGES)
    per_row = [pl.BlockSpec((None, n), lambda i: (i, 0)) for n in (maxima.shape[1], length, max_held + 1, 2, k + 1)]
    maxima_spec, row_spec, list_spec, info_spec, out_spec = per_row
    keys, positions, info = pl.pallas_call(
        functools.partial(_bound_kernel, rank=rank, length=length, chunk=chunk),
        grid=(r,),
        in_specs=[maxima_spec, row_spec],
        out_specs=[list_spec, list_spec, info_spec],
        out_shape=[jax.ShapeDtypeStruct((r, max_held + 1), jnp.int32)] * 2 + [jax.ShapeDtypeStruct((r, 2), jnp.int32)],
        compiler_params=params,
        interpret=interpret,
        name="top_k_bound",
    )(maxima, rows)
    out = pl.pallas_call(
        functools.partial(_positions_kernel, k=k, length=length, chunk=chunk),
        grid=(r,),
        in_specs=[info_spec, list_spec, list_spec, row_spec],
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct((r, k + 1), jnp.int32),
        compiler_params=params,
        interpret=interpret,
        name="top_k_positions",
    )(info, keys, positions, rows)
    return out[:, :k].reshape(*lead, k)


def _check(scores, k, chunk, max_held):
    if scores.dtype != jnp.float32 or scores.ndim < 1:
        raise ValueError(f"scores must be float32 [..., S], got {scores.dtype} {scores.shape}")
    if not isinstance(k, int) or not 0 < k <= scores.shape[-1]:
        raise ValueError(f"k={k!r} must be an int in 1..{scores.shape[-1]} (the row length)")
    c.check_block("chunk", chunk)
    c.check_block("max_held", max_held)
    tile_for(scores.shape[-1], k, max_held)


def top_k_positions(scores, k: int, *, chunk: int = CHUNK, max_held: int = MAX_HELD, interpret: bool = False,
                    num_warps: int | None = None, num_stages: int | None = None):
    """int32 [..., k]: the ascending positions of the k largest entries of each row of float32 `scores` [..., S]
    (values in IEEE total order, ties to the lower position), by the two kernels of the module docstring. Any S;
    k at most max_held / tile (`tile_for`: 2048 at 128k keys, 1024 at S = 131200). `chunk`: keys per step of a pass
    over a row; `max_held`: the most values a program ranks in registers (powers of two; smaller ones test the
    module's paths on short rows)."""
    _check(scores, k, chunk, max_held)
    return _top_k_positions(scores, k=k, chunk=chunk, max_held=max_held, num_warps=num_warps, num_stages=num_stages,
                            interpret=interpret)


def top_k_positions_reference(scores, k: int, *, chunk: int = CHUNK, max_held: int = MAX_HELD,
                              interpret: bool = False, num_warps: int | None = None, num_stages: int | None = None):
    """The same function as `top_k_positions`: `lax.top_k` of the keys, then sorted."""
    del interpret, num_warps, num_stages
    _check(scores, k, chunk, max_held)
    return jnp.sort(jax.lax.top_k(keys_of(scores), k)[1], axis=-1).astype(jnp.int32)
