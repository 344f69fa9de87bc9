"""The positions of the k largest scores of each row, ascending: the selection MAGE and PulseCol make.

`top_k_positions(scores, k)` equals `jnp.sort(jax.lax.top_k(scores, k)[1])` (ties go to the lower
position, as in `lax.top_k`'s stable order, and values compare in IEEE total order as there: -0.0 below
0.0), computed one of two ways:

- "sort": `lax.top_k` then a sort of the k picks (the reference, MAGE's default). XLA sorts each whole
  row to find its top k.
- "threshold": a radix search for the k-th largest value (a few counting passes over the row, each
  fixing `bits` bits of it), then the entries above it plus the lowest-positioned ties, read off in
  position order by a binary search over their running count. Nothing is sorted, but the passes and the
  search each launch kernels of their own: in MAGE's loop at 128k keys and batch 1 (H100) the block took
  74.0 ms against the sort's 70.6 (benchmarks/results/throughput_issue40_*; `benchmarks/mage_select.py`
  times the selection alone).

Callers mask what they do not rank with -inf.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

METHODS = ("sort", "threshold")


def check_method(method: str, name: str = "method") -> None:
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"{name}={method!r} is not one of {METHODS}")


def top_k_positions(scores, k: int, *, method: str = "sort", bits: int = 4):
    """int32 [..., k]: ascending positions of the k largest entries of each row of float `scores`
    [..., S] (k <= S). `bits` (a divisor of 32) is how many bits of the k-th largest value each
    counting pass of "threshold" fixes: 2**bits - 1 comparisons per entry per pass, 32 / bits passes."""
    check_method(method)
    s = scores.shape[-1]
    if not 0 < k <= s:
        raise ValueError(f"k={k} must be in 1..{s} (the row length)")
    if not isinstance(bits, int) or bits < 1 or 32 % bits:
        raise ValueError(f"bits={bits} must divide 32")
    if method == "sort":
        return jnp.sort(jax.lax.top_k(scores, k)[1], axis=-1).astype(jnp.int32)
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
