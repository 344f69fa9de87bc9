"""Pieces shared by the attention kernels: input checks, padding, and the fp32 online-softmax tile
update (FlashAttention-2, Algorithm 1) that every kernel runs over its own choice of key tiles.

Ignored keys (past kv_len, index padding, unlisted): their logits are -inf and their values are
zeroed where a tile is loaded (`mask_values`), so whatever they hold, NaN and Inf included, cannot
reach an output; the jnp references follow the same contract (`dense_reference`).

Units: inside a kernel, logits are kept in base 2 (scaled by scale * log2(e)) so that the softmax
uses `exp2`; every LSE that leaves a kernel is the natural-log log-sum-exp of the scaled logits, in
float32, laid out [batch, heads, queries].
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as pltriton

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# weights held in one byte per value (with a float32 scale) that the matmul kernels cast in registers
BYTE_WEIGHT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))
# Triton lowers DEFAULT/HIGH fp32 dots to TF32 (~1e-3 error); HIGHEST asks for IEEE fp32. bf16 and
# f16 dots are unaffected (their inputs are exact on the tensor cores either way).
EXACT_F32 = jax.lax.Precision.HIGHEST
HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two (Triton tiles); 64 and 128 are the tuned ones


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_concrete(*xs) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in xs)


# Shared memory a Triton program may use for its pipelined K/V tiles: 227 KiB on Hopper per block, less
# what the query tile and the compiler's scratch take
PIPELINE_SMEM = 200 * 1024


def fitting_stages(preferred: int, *, rows: int, head_dim: int, dtype, reserved: int = 0) -> int:
    """`preferred` pipeline stages, fewer where that many K and V tiles of `rows` x `head_dim` would not
    fit in shared memory beside `reserved` bytes the kernel needs besides (float32 at head_dim 128 with 128-row
    tiles: 3 stages ask 384 KiB and the launch fails with RESOURCE_EXHAUSTED)."""
    per_stage = 2 * rows * head_dim * jnp.dtype(dtype).itemsize
    return max(1, min(preferred, (PIPELINE_SMEM - reserved) // per_stage))


def compiler_params(head_dim: int, num_warps: int | None, num_stages: int | None):
    return pltriton.CompilerParams(
        num_warps=num_warps if num_warps is not None else (4 if head_dim <= 64 else 8),
        num_stages=num_stages if num_stages is not None else 2,
    )


def check_block(name: str, value: int, *, minimum: int = 16) -> None:
    if not isinstance(value, (int, np.integer)) or not is_pow2(int(value)) or value < minimum:
        raise ValueError(f"{name}={value!r} must be a power of two >= {minimum} (Triton tile sizes)")


def check_qkv(q, k, v) -> tuple[int, int, int, int, int, int]:
    """Checks q [B, Nq, Hq, D], k and v [B, Nk, Hkv, D]; returns (B, Nq, Nk, Hq, Hkv, D)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {x.shape}")
        if jnp.dtype(x.dtype) not in DTYPES:
            raise ValueError(f"{name}.dtype={x.dtype} is not supported; use bfloat16, float16 or float32")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {k.shape} and {v.shape}")
    b, nq, hq, d = q.shape
    bk, nk, hkv, dk = k.shape
    if bk != b:
        raise ValueError(f"q has batch {b} but k/v have batch {bk}")
    if dk != d:
        raise ValueError(f"q has head_dim {d} but k/v have head_dim {dk}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim={d} is not supported; supported: {HEAD_DIMS}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if nq == 0 or nk == 0:
        raise ValueError(f"empty sequence: q has {nq} queries, k has {nk} keys")
    return b, nq, nk, hq, hkv, d


def check_scale(scale) -> float | None:
    """`scale` checked on the host, as a float (None stays None: the default 1/sqrt(head_dim)).

    Every kernel entry point and reference calls this first, so a bad scale raises before anything
    is traced or compiled. NaN or Inf would make every output NaN, and a scale <= 0 inverts or
    flattens the softmax (the Mosaic kernel folds a positive one into its row maximum); bools and
    strings are refused rather than read as 1.0 or parsed. A traced scale is refused too: the kernels
    compile it in as a static argument. (pallas_kernels imports nothing from dllm_jax, whose
    `validation.real` states the same rule.)"""
    if scale is None:
        return None
    is_real = isinstance(scale, numbers.Real) or (
        getattr(scale, "shape", None) == () and np.issubdtype(getattr(scale, "dtype", np.object_), np.number)
        and not np.issubdtype(scale.dtype, np.complexfloating))
    if not is_real or isinstance(scale, (bool, np.bool_)):
        raise ValueError(f"scale must be a real number > 0 (or None: 1/sqrt(head_dim)), got {scale!r} "
                         f"({type(scale).__name__})")
    try:
        value = float(scale)
    except TypeError as e:  # a JAX tracer (ConcretizationTypeError is a TypeError)
        raise ValueError(f"scale must be a concrete number (a static argument of the kernels), got a traced "
                         f"{type(scale).__name__}") from e
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"scale must be a finite number > 0 (or None: 1/sqrt(head_dim)), got {value}")
    return value


def resolve_scale(scale, head_dim: int) -> float:
    """The softmax scale a kernel compiles in: `check_scale(scale)`, or 1/sqrt(head_dim) for None."""
    scale = check_scale(scale)
    return 1.0 / math.sqrt(head_dim) if scale is None else scale


def kv_lengths(kv_len, batch: int, num_keys: int) -> jax.Array:
    """`kv_len` (None, an int, or int [B]) as int32 [B]. Concrete values are checked to lie in
    [0, num_keys]; traced values are clamped to that range (a documented safe clamp)."""
    if kv_len is None:
        return jnp.full((batch,), num_keys, jnp.int32)
    arr = jnp.asarray(kv_len)
    if not jnp.issubdtype(arr.dtype, jnp.integer):
        raise ValueError(f"kv_len must be an integer or an integer array, got dtype {arr.dtype}")
    if arr.ndim > 1 or (arr.ndim == 1 and arr.shape[0] != batch):
        raise ValueError(f"kv_len must be a scalar or shape [{batch}], got shape {arr.shape}")
    if is_concrete(kv_len):
        values = np.asarray(kv_len)
        if values.min() < 0 or values.max() > num_keys:
            raise ValueError(f"kv_len={values.tolist()} out of range [0, {num_keys}]")
    return jnp.broadcast_to(jnp.clip(arr, 0, num_keys), (batch,)).astype(jnp.int32)


def check_index_lists(indices, counts, *, name: str, lead: Sequence[int], heads: Sequence[int],
                      limit: int, unique: bool = True) -> tuple[jax.Array, jax.Array]:
    """Validates padded index lists `indices` int32 [B, Hi, rows, max] and `counts` [B, Hi, rows]
    (Hi one of `heads`), entries below the count in [0, limit) and, if `unique`, distinct.

    Concrete inputs are checked on the host and raise ValueError. Traced inputs cannot be: they are
    clamped into range (counts to [0, max], indices to [0, limit-1]) so that the kernel never reads
    out of bounds; a duplicate inside jit is counted twice. Padding beyond the count is never read
    for its value but is clamped too, as gathers load whole tiles."""
    b, rows = lead
    if indices.ndim != 4 or counts.ndim != 3:
        raise ValueError(f"{name} indices must be [B, H, rows, max] and counts [B, H, rows]; "
                         f"got {indices.shape} and {counts.shape}")
    if not (jnp.issubdtype(indices.dtype, jnp.integer) and jnp.issubdtype(counts.dtype, jnp.integer)):
        raise ValueError(f"{name} indices and counts must be integers, got {indices.dtype}, {counts.dtype}")
    hi = indices.shape[1]
    if indices.shape[0] != b or indices.shape[2] != rows or hi not in heads:
        raise ValueError(f"{name} indices have shape {indices.shape}; expected [{b}, one of {tuple(heads)}, "
                         f"{rows}, max]")
    if counts.shape != indices.shape[:3]:
        raise ValueError(f"{name} counts have shape {counts.shape}; expected {indices.shape[:3]}")
    width = indices.shape[3]
    if width == 0:
        raise ValueError(f"{name} indices have an empty last axis; pad to at least one entry")
    if is_concrete(indices, counts):
        idx, cnt = np.asarray(indices), np.asarray(counts)
        if cnt.min() < 0 or cnt.max() > width:
            raise ValueError(f"{name} counts must lie in [0, {width}], got range [{cnt.min()}, {cnt.max()}]")
        live = np.arange(width) < cnt[..., None]
        bad = live & ((idx < 0) | (idx >= limit))
        if bad.any():
            where = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{name} index {int(idx[where])} at {where} is out of range [0, {limit})")
        if unique:
            sentinel = -1 - np.arange(width)  # distinct negatives: only live entries can collide
            ordered = np.sort(np.where(live, idx, sentinel), axis=-1)
            dup = (np.diff(ordered, axis=-1) == 0) & (ordered[..., 1:] >= 0)
            if dup.any():
                where = tuple(int(i) for i in np.argwhere(dup)[0][:3])
                raise ValueError(f"{name} indices repeat an entry in row {where}: each index may appear once")
    indices = jnp.clip(indices.astype(jnp.int32), 0, limit - 1)
    counts = jnp.clip(counts.astype(jnp.int32), 0, width)
    return indices, counts


def mask_to_lists(mask, width: int):
    """bool [..., n] -> (ascending int32 indices [..., width] padded by repeating the last, counts)."""
    counts = jnp.sum(mask, axis=-1).astype(jnp.int32)
    order = jnp.argsort(~mask, axis=-1, stable=True)[..., :width].astype(jnp.int32)
    last = jnp.take_along_axis(order, jnp.maximum(counts - 1, 0)[..., None], axis=-1)
    return jnp.where(jnp.arange(width) < counts[..., None], order, last), counts


def pad_axis(x: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    extra = size - x.shape[axis]
    if extra == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def pad_last_repeat(x: jax.Array, size: int) -> jax.Array:
    """Pads the last axis to `size` by repeating its last entry (keeps padded index lists valid)."""
    extra = size - x.shape[-1]
    if extra == 0:
        return x
    return jnp.concatenate([x, jnp.repeat(x[..., -1:], extra, axis=-1)], axis=-1)


def logits(q, k, scale_log2: float):
    """Base-2 scaled logits of a query tile [m, D] against a key tile [n, D]: f32 [m, n]."""
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=EXACT_F32, preferred_element_type=jnp.float32)
    return s * scale_log2


def prob_shift(lse):
    """Base-2 shift turning base-2 logits into probabilities: exp2(s - shift). A row with no keys
    (lse = -inf) gets +inf, so its probabilities are 0 rather than NaN."""
    return jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)


def init_carry(rows: int, head_dim: int):
    return (jnp.zeros((rows, head_dim), jnp.float32),
            jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def tile_update(carry, q, k, v, scale_log2: float, valid=None):
    """One online-softmax step over a key tile; `valid` bool [n] marks the keys to use (None: all)."""
    return masked_update(carry, logits(q, k, scale_log2), v, valid)


def masked_update(carry, s, v, valid=None):
    """`logits_update` for base-2 logits s [m, n] already computed, `valid` bool [n] marking the keys to use."""
    if valid is not None:
        s = jnp.where(valid[None, :], s, -jnp.inf)
        v = mask_values(v, valid)
    return logits_update(carry, s, v)


def mask_values(v, valid):
    """v [n, D] with the rows of ignored keys (valid bool [n] False) set to 0. Their probabilities are
    0, but 0 * NaN = NaN: whatever an ignored cache slot or padding entry holds (NaN, Inf) must not
    reach the output. One select on a loaded tile; a no-op on finite values."""
    return jnp.where(valid[:, None], v, jnp.zeros_like(v))


def rescale(carry, row_max):
    """The running maximum raised to include `row_max` [m]: (shift, alpha, m_new), where exp2(s - shift)
    are the tile's probabilities and alpha rescales the old accumulators."""
    _, m, _ = carry
    m_new = jnp.maximum(m, row_max)
    # A row that has seen only masked keys keeps m = -inf; shift by 0 there so exp2 gives 0, not NaN.
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    return shift, jnp.exp2(m - shift), m_new


def logits_update(carry, s, v, v_scale=None):
    """The online-softmax step for base-2 logits s [m, n] (masked keys at -inf) and values v [n, D]; v_scale f32
    [n] (a quantized cache's value scales, finite) multiplies each value row, applied to the probabilities'
    columns instead (n multiplies per query row rather than n * D)."""
    acc, _, l = carry
    shift, alpha, m_new = rescale(carry, jnp.max(s, axis=1))
    p = jnp.exp2(s - shift[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    weights = p if v_scale is None else p * v_scale[None, :]
    pv = jax.lax.dot_general(weights.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=EXACT_F32,
                             preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_new, l


def finalize(carry):
    """(o f32 [m, D], natural-log lse f32 [m]); rows that saw no key give o = 0 and lse = -inf."""
    acc, m, l = carry
    empty = l == 0.0
    o = acc / jnp.where(empty, 1.0, l)[:, None]
    lse = jnp.where(empty, -jnp.inf, (m + jnp.log2(jnp.where(empty, 1.0, l))) * LN2)
    return o, lse


@functools.partial(jax.jit, static_argnames="scale")  # one compiled program: eager op-by-op costs seconds per shape
def dense_reference(q, k, v, allowed, scale: float):
    """fp32 masked attention: q [B,Nq,Hq,D], k/v [B,Nk,Hkv,D], allowed bool broadcastable to
    [B,Hq,Nq,Nk]. Returns (o [B,Nq,Hq,D] in q.dtype, lse f32 [B,Hq,Nq]); empty rows give 0 / -inf.

    As in the kernels, a key a row does not attend contributes nothing, whatever K and V hold there
    (NaN, Inf); a non-finite value at a key it does attend makes that output element non-finite
    (NaN here; the kernels give NaN or Inf)."""
    hq, hkv = q.shape[2], k.shape[2]
    kf = jnp.repeat(k.astype(jnp.float32), hq // hkv, axis=2)
    vf = jnp.repeat(v.astype(jnp.float32), hq // hkv, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf,
                   precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(allowed, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(allowed, jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    # p = 0 at ignored keys, but 0 * NaN = NaN: multiply by finite values only, then poison exactly
    # the elements that attend a non-finite value (a second einsum, run only when V has one)
    finite = jnp.isfinite(vf)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, jnp.where(finite, vf, 0.0), precision=jax.lax.Precision.HIGHEST)
    o = jax.lax.cond(jnp.all(finite), _unchanged, _poison_attended, o, allowed, finite)
    return o.astype(q.dtype), lse


# module-level branches: eager calls of dense_reference reuse one traced and compiled cond
def _unchanged(o, allowed, finite):
    del allowed, finite
    return o


def _poison_attended(o, allowed, finite):
    """o [B,Nq,Hq,D] with NaN where the row attends (allowed) a key whose value (finite [B,Nk,Hq,D]) is not finite."""
    b, nq, hq, _ = o.shape
    attends = jnp.broadcast_to(allowed, (b, hq, nq, finite.shape[1])).astype(jnp.float32)
    hit = jnp.einsum("bhqk,bkhd->bqhd", attends, (~finite).astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return jnp.where(hit > 0, jnp.nan, o)
