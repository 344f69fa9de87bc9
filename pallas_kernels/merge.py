"""Log-sum-exp composition of attention results over disjoint key sets (FlashBlock's merge, and the
combine step of split-KV attention).

For two partial results over key sets S1, S2 with natural-log LSEs L1, L2:
  m = max(L1, L2), w_i = exp(L_i - m), o = (w1 o1 + w2 o2) / (w1 + w2), L = m + log(w1 + w2).
This is an elementwise op: XLA fuses it into one pass, so it needs no Pallas kernel.

The LSE contract (kernel and reference alike):
  - L = -inf is a valid empty part (no keys): weight 0, and its o is ignored whatever it holds
    (0 * NaN would otherwise leak a never-written buffer); both empty gives o = 0 and L = -inf.
  - L = +inf or NaN is invalid (no finite set of finite logits has it). `merge_attention` raises
    ValueError naming the argument and the first bad position when the LSEs are concrete; under
    jit it cannot look, and every such row comes out with o = NaN and L = NaN, so the error stays
    visible downstream instead of turning into a finite wrong answer.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import is_concrete


def invalid_lse(lse):
    """bool mask of LSE entries outside the contract (+inf or NaN)."""
    return jnp.isnan(lse) | (lse == jnp.inf)


def combine_partials(o, lse, axis: int = 0):
    """Merges partials stacked along `axis`: o [..., S, ..., rows, D] f32 and lse shaped like o
    without its last axis. Returns (o f32, lse f32) with `axis` removed; rows with an invalid
    partial LSE (+inf, NaN) give NaN (see the module docstring)."""
    invalid = jnp.any(invalid_lse(lse), axis=axis)
    m = jnp.max(lse, axis=axis)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    w = jnp.exp(lse - jnp.expand_dims(m, axis))  # exp(-inf) = 0 for empty partials
    total = jnp.sum(w, axis=axis)
    empty = total == 0
    weighted = jnp.where((lse == -jnp.inf)[..., None], 0.0, w[..., None] * o.astype(jnp.float32))
    o = jnp.sum(weighted, axis=axis) / jnp.where(empty, 1.0, total)[..., None]
    lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, total)))
    return jnp.where(invalid[..., None], jnp.nan, o), jnp.where(invalid, jnp.nan, lse)


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
        if is_concrete(lse):  # traced LSEs cannot be looked at: see the module docstring
            values = np.asarray(lse)
            bad = np.argwhere(np.isnan(values) | (values == np.inf))
            if bad.size:
                where = tuple(int(i) for i in bad[0])
                raise ValueError(f"{name}[{', '.join(map(str, where))}] = {float(values[where])}: an LSE must be "
                                 f"finite or -inf (an empty part); {len(bad)} entries are +inf or NaN")


def merge_attention(o1, lse1, o2, lse2):
    """Merges attention over two disjoint key sets.

    Args:
      o1, o2: [B, N, H, D] normalised partial outputs (any float dtype).
      lse1, lse2: f32 [B, H, N] natural-log LSEs of the scaled logits (-inf where a side had no keys;
        that side's o is then ignored). +inf or NaN raises ValueError when the LSEs are concrete;
        traced (inside jit), such rows give o = NaN and lse = NaN.

    Returns (o [B, N, H, D] in the promoted dtype of o1 and o2, lse f32 [B, H, N]).
    """
    _check(o1, lse1, o2, lse2)
    dtype = jnp.result_type(o1.dtype, o2.dtype)
    stacked_o = jnp.stack([o1, o2]).transpose(0, 1, 3, 2, 4)  # [2, B, H, N, D]
    o, lse = combine_partials(stacked_o, jnp.stack([lse1, lse2]), axis=0)
    return o.transpose(0, 2, 1, 3).astype(dtype), lse


def merge_attention_reference(o1, lse1, o2, lse2):
    """The same merge written directly from the definition with `logaddexp` (same LSE contract)."""
    _check(o1, lse1, o2, lse2)
    dtype = jnp.result_type(o1.dtype, o2.dtype)
    invalid = invalid_lse(lse1) | invalid_lse(lse2)
    lse = jnp.logaddexp(lse1, lse2)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)

    def part(o, lse_part):  # an empty part (-inf) adds exactly 0, whatever its o holds
        w = jnp.exp(lse_part - safe).transpose(0, 2, 1)[..., None]
        return jnp.where(jnp.isfinite(lse_part).transpose(0, 2, 1)[..., None], w * o.astype(jnp.float32), 0.0)

    o = part(o1, lse1) + part(o2, lse2)
    o = jnp.where(invalid.transpose(0, 2, 1)[..., None], jnp.nan, o)
    return o.astype(dtype), jnp.where(invalid, jnp.nan, lse)
