"""The positions of the k largest scores of each row, ascending: the selection MAGE makes (PulseCol picks its columns
by `lax.top_k` directly).

`top_k_positions(scores, k)` equals `jnp.sort(jax.lax.top_k(scores, k)[1])` (ties go to the lower
position, as in `lax.top_k`'s stable order, and values compare in IEEE total order as there: -0.0 below
0.0), computed one of three ways:

- "sort": `lax.top_k` then a sort of the k picks. XLA:GPU sorts a row to find its top k, so
  there a row longer than `chunk` is cut into chunks (the last padded with -inf): the top k of each chunk, then the
  top k of those candidates. Exact, ties included: a chunk's picks come in `lax.top_k`'s order and the
  chunks in position order, so equal values still go to the lower position. At 128k keys one sort of the
  whole row took ~29 launches per layer and row block (7.9 ms of MAGE's 37 ms of GPU time per output block,
  batch 1, H200). XLA:CPU's top k needs no full sort, and chunks made it slower there (20k keys: 3.5 ms whole,
  7.5 ms by chunks of 8192), so elsewhere rows are ranked whole unless `chunk` is given.
- "tiles": a tournament. A row is cut into tiles of `tile` positions and each tile's largest value kept; the k
  tiles with the largest maxima (found the same way, recursively, until a row of maxima is short enough for
  one `lax.top_k`) hold the whole top k: a key outside them has k tile maxima at or above it, each ranking
  ahead of it (ties too: tiles are ranked with ties to the lower tile, which holds the lower positions). The
  top k of those k * tile candidates, gathered in position order, is the answer. At 128k keys, k = 512 and
  tiles of 8 that is one `lax.top_k` over 2,048 maxima and two over 4,096 candidates per row, where "sort"
  ranks 32 chunks of 4,096 and then 16,384 candidates. Values are compared as their IEEE total-order keys
  (`ordered_keys`), so a tile's maximum ranks as `lax.top_k` would rank it. A row of at most k tiles is ranked
  by one `lax.top_k`, and so is every row off a GPU unless `tile` is given (a tournament compiles into a larger
  program, and XLA:CPU's top k sorts nothing whole). MAGE's default: at 128k keys, batch 4 (H200) 0.12 ms per layer
  against the chunked sort's 0.34 (`benchmarks/mage_select.py`).
- "threshold": a radix search for the k-th largest value (a few counting passes over the row, each
  fixing `bits` bits of it), then the entries above it plus the lowest-positioned ties, read off in
  position order by a binary search over their running count. Nothing is sorted, but the passes and the
  search each launch kernels of their own: in MAGE's loop at 128k keys and batch 1 (H100) the block took
  74.0 ms against the sort's 70.6 (benchmarks/results/throughput_issue40_*; `benchmarks/mage_select.py`
  times the selection alone).

Callers mask what they do not rank with -inf. A Pallas kernel that finds them without a sort
(`pallas_kernels.top_k_positions`: two launches per row block) launches fewer kernels but spends more GPU time per
block and is no faster end to end; `benchmarks/mage_select.py` keeps the comparison.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as pk

METHODS = ("sort", "tiles", "threshold")
# "tiles": positions per tile on a GPU. Tiles of 4, 8 and 16 select within 8% of each other alone at 128k (H200,
# benchmarks/results/mage_select_*.md). Not 16: in MAGE's loop its sort kernels are shorter, but XLA sorts its
# 8,192 candidates per row in several launches, so a block launches more kernels and spends slightly more GPU time
# in all (docs/benchmarks.md)
TILE = 8
SORT_CHUNK = 4096  # "sort": the longest row sorted whole (the fastest of 2048-16384 at 128k, batches 1 and 4:
# benchmarks/mage_select.py on an H200, benchmarks/results/mage_select_*.md)


def check_method(method: str, name: str = "method") -> None:
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"{name}={method!r} is not one of {METHODS}")


def top_k_positions(scores, k: int, *, method: str = "sort", bits: int = 4, chunk: int | None = None,
                    tile: int | None = None):
    """int32 [..., k]: ascending positions of the k largest entries of each row of float `scores`
    [..., S] (k <= S). `bits` (a divisor of 32) is how many bits of the k-th largest value each
    counting pass of "threshold" fixes: 2**bits - 1 comparisons per entry per pass, 32 / bits passes.
    `chunk`: the longest row "sort" sorts whole (None: SORT_CHUNK on a GPU, any row elsewhere; the module
    docstring). `tile`: the positions per tile of "tiles" (at least 2; None: TILE on a GPU, the whole row elsewhere)."""
    check_method(method)
    s = scores.shape[-1]
    if not 0 < k <= s:
        raise ValueError(f"k={k} must be in 1..{s} (the row length)")
    if not isinstance(bits, int) or bits < 1 or 32 % bits:
        raise ValueError(f"bits={bits} must divide 32")
    if chunk is None:
        chunk = SORT_CHUNK if jax.default_backend() == "gpu" else s
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk={chunk!r} must be a positive int")
    if tile is None:  # as chunk: on a CPU one lax.top_k of the whole row, which sorts nothing whole there
        tile = TILE if jax.default_backend() == "gpu" else max(s, 2)
    if not isinstance(tile, int) or tile < 2:
        raise ValueError(f"tile={tile!r} must be an int >= 2")
    if method == "tiles":
        return jnp.sort(tiled_top_k(signed_keys(scores), k, tile), axis=-1).astype(jnp.int32)
    if method == "sort":
        return jnp.sort(chunked_top_k(scores, k, chunk), axis=-1).astype(jnp.int32)
    keys = ordered_keys(scores)
    kth = kth_largest(keys, k, bits)[..., None]
    above = keys > kth
    ties = keys == kth
    # the ties the top k takes are its lowest-positioned ones: k minus the entries above the k-th value
    room = k - jnp.sum(above, axis=-1, keepdims=True, dtype=jnp.int32)
    taken = above | (ties & (jnp.cumsum(ties, axis=-1, dtype=jnp.int32) <= room))
    running = jnp.cumsum(taken, axis=-1, dtype=jnp.int32)  # exactly k taken per row
    # the j-th taken position is the first whose running count reaches j + 1
    find = jnp.vectorize(lambda row: jnp.searchsorted(row, jnp.arange(1, k + 1, dtype=jnp.int32), side="left"),
                         signature="(s)->(k)")
    return find(running).astype(jnp.int32)


def chunked_top_k(scores, k: int, chunk: int):
    """`lax.top_k(scores, k)[1]`, by chunks of `chunk` positions where a row is longer (and k fits in one)."""
    s = scores.shape[-1]
    if s <= chunk or k > chunk:
        return jax.lax.top_k(scores, k)[1]
    count = -(-s // chunk)
    padded = jnp.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(0, count * chunk - s)], constant_values=-jnp.inf)
    values, picks = jax.lax.top_k(padded.reshape(scores.shape[:-1] + (count, chunk)), k)
    picks = picks + (jnp.arange(count, dtype=picks.dtype) * chunk)[:, None]
    flat = scores.shape[:-1] + (count * k,)
    # the padding's -inf sits after every real position, so a real -inf wins the tie
    return jnp.take_along_axis(picks.reshape(flat), jax.lax.top_k(values.reshape(flat), k)[1], axis=-1)


def tiled_top_k(keys, k: int, tile: int):
    """The positions of the top k of each row of int32 `keys` [..., S] (ties to the lower position), in no
    particular order: by tile maxima where a row has more than k tiles, else one `lax.top_k` (module docstring)."""
    s = keys.shape[-1]
    tiles = -(-s // tile)
    if tiles <= k:
        return jax.lax.top_k(keys, k)[1]
    # the padding (the lowest key, after every real position) loses every tie to a real entry
    padded = jnp.pad(keys, [(0, 0)] * (keys.ndim - 1) + [(0, tiles * tile - s)],
                     constant_values=jnp.iinfo(jnp.int32).min)
    maxima = jnp.max(padded.reshape(keys.shape[:-1] + (tiles, tile)), axis=-1)
    chosen = jnp.sort(tiled_top_k(maxima, k, tile), axis=-1)  # k tiles, in position order
    positions = (chosen[..., None] * tile + jnp.arange(tile, dtype=chosen.dtype)).reshape(keys.shape[:-1] + (-1,))
    candidates = jnp.take_along_axis(padded, positions, axis=-1)
    return jnp.take_along_axis(positions, tiled_top_k(candidates, k, tile), axis=-1)


def signed_keys(scores):
    """int32 keys in the IEEE total order of the float32 values (`ordered_keys` with the sign bit flipped:
    signed comparison of these is unsigned comparison of those), as the top-k kernel ranks them."""
    return pk.top_k.keys_of(scores.astype(jnp.float32))


def ordered_keys(scores):
    """uint32 keys in the IEEE total order of the float32 values: unsigned comparison of the keys is the
    values' comparison (negatives reversed below positives, -0.0 just below 0.0)."""
    bits = jax.lax.bitcast_convert_type(scores.astype(jnp.float32), jnp.uint32)
    negative = bits >> 31 == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(1 << 31))


def kth_largest(keys, k: int, bits: int):
    """uint32 [...]: the k-th largest of each row of uint32 `keys` [..., S], `bits` bits per pass from
    the top: the largest t such that at least k keys are >= t."""
    digits = jnp.arange(1, 2 ** bits, dtype=jnp.uint32)  # the candidate values of the next digit

    def one_pass(i, t):
        shift = (32 - bits * (i + 1)).astype(jnp.uint32)
        candidates = t[..., None] | (digits << shift)  # [..., 2**bits - 1], increasing
        counts = jnp.sum(keys[..., None, :] >= candidates[..., None], axis=-1, dtype=jnp.int32)
        # the largest digit that still leaves k keys at or above it (0 if none does)
        digit = jnp.sum(counts >= k, axis=-1, dtype=jnp.uint32)
        return t | (digit << shift)

    return jax.lax.fori_loop(0, 32 // bits, one_pass, jnp.zeros(keys.shape[:-1], jnp.uint32))
