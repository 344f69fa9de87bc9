"""Log-sum-exp composition of attention results over disjoint key sets (FlashBlock's merge, and the
combine step of split-KV attention).

For two partial results over key sets S1, S2 with natural-log LSEs L1, L2:
  m = max(L1, L2), w_i = exp(L_i - m), o = (w1 o1 + w2 o2) / (w1 + w2), L = m + log(w1 + w2).
A side with L = -inf (no keys) has weight 0; both empty gives o = 0 and L = -inf. This is an
elementwise op: XLA fuses it into one pass, so it needs no Pallas kernel.
"""

from __future__ import annotations

import jax.numpy as jnp


def combine_partials(o, lse, axis: int = 0):
    """Merges partials stacked along `axis`: o [..., S, ..., rows, D] f32 and lse shaped like o
    without its last axis. Returns (o f32, lse f32) with `axis` removed."""
    m = jnp.max(lse, axis=axis)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - jnp.expand_dims(m, axis))  # exp(-inf) = 0 for empty partials
    total = jnp.sum(w, axis=axis)
    empty = total == 0
    o = jnp.sum(w[..., None] * o.astype(jnp.float32), axis=axis) / jnp.where(empty, 1.0, total)[..., None]
    return o, jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, total)))


def _check(o1, lse1, o2, lse2):
    if o1.shape != o2.shape:
        raise ValueError(f"o1 and o2 must have the same shape, got {o1.shape} and {o2.shape}")
    if o1.ndim != 4:
        raise ValueError(f"o must be [batch, seq, heads, head_dim], got shape {o1.shape}")
    b, n, h, _ = o1.shape
    for name, lse in (("lse1", lse1), ("lse2", lse2)):
        if lse.shape != (b, h, n):
            raise ValueError(f"{name} must be [batch, heads, seq] = {(b, h, n)}, got {lse.shape}")
        if lse.dtype != jnp.float32:
            raise ValueError(f"{name} must be float32 (a bf16 LSE loses the merge), got {lse.dtype}")


def merge_attention(o1, lse1, o2, lse2):
    """Merges attention over two disjoint key sets.

    Args:
      o1, o2: [B, N, H, D] normalised partial outputs (any float dtype).
      lse1, lse2: f32 [B, H, N] natural-log LSEs of the scaled logits (-inf where a side had no keys).

    Returns (o [B, N, H, D] in the promoted dtype of o1 and o2, lse f32 [B, H, N]).
    """
    _check(o1, lse1, o2, lse2)
    dtype = jnp.result_type(o1.dtype, o2.dtype)
    stacked_o = jnp.stack([o1, o2]).transpose(0, 1, 3, 2, 4)  # [2, B, H, N, D]
    o, lse = combine_partials(stacked_o, jnp.stack([lse1, lse2]), axis=0)
    return o.transpose(0, 2, 1, 3).astype(dtype), lse


def merge_attention_reference(o1, lse1, o2, lse2):
    """The same merge written directly from the definition with `logaddexp`."""
    _check(o1, lse1, o2, lse2)
    dtype = jnp.result_type(o1.dtype, o2.dtype)
    lse = jnp.logaddexp(lse1, lse2)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w1 = jnp.where(jnp.isfinite(lse1), jnp.exp(lse1 - safe), 0.0).transpose(0, 2, 1)[..., None]
    w2 = jnp.where(jnp.isfinite(lse2), jnp.exp(lse2 - safe), 0.0).transpose(0, 2, 1)[..., None]
    o = w1 * o1.astype(jnp.float32) + w2 * o2.astype(jnp.float32)
    return o.astype(dtype), lse
