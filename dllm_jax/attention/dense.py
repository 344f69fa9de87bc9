"""Dense attention: the default every model layer calls, and what sparse policies replace.

Layout (contract): q [B, L, Hq, D], k/v [B, S, Hkv, D], Hq % Hkv == 0; output [B, L, Hq, D].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from dllm_jax.attention import backends


def matmul_precision(dtype):
    """HIGHEST for fp32 (XLA would otherwise use TF32 on NVIDIA GPUs), DEFAULT for bf16/fp16."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def combined_mask(key_mask, mask, kv_len, n: int, s: int):
    """The bool [B|1, 1, L, S] mask (True = attend) of the three ways to hide keys, or None."""
    parts = []
    if key_mask is not None:
        parts.append(key_mask[:, None, None, :])
    if mask is not None:
        parts.append(mask[None, None] if mask.ndim == 2 else mask[:, None])
    if kv_len is not None:
        kv_len = jnp.reshape(jnp.asarray(kv_len, jnp.int32), (-1, 1, 1, 1))
        parts.append(jnp.arange(s)[None, None, None, :] < kv_len)
    if not parts:
        return None
    out = parts[0]
    for part in parts[1:]:
        out = out & part
    return jnp.broadcast_to(out, (out.shape[0], 1, n, s))


def xla_attention(q, k, v, *, key_mask=None, mask=None, kv_len=None, scale=None):
    """Plain softmax(q kᵀ·scale) v with fp32 logits and softmax; GQA by grouping query heads.

    A row whose keys are all masked gets a uniform softmax (as torch with a finfo.min bias).
    """
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    scale = d ** -0.5 if scale is None else scale
    precision = matmul_precision(q.dtype)
    # head-major operands ([B, Hkv, ...]): both products are then batched matmuls over leading axes, which
    # XLA:CPU runs far faster than sequence-major einsums (2-core machine, bf16, query chunks: [10, 1030] with
    # 8:4 heads of 32 208 against 363 ms a layer; [10, 4096] block-causal with heads of 64 1.91 against 3.49 s;
    # 10 trained-LLaDA passkey samples at 1k 12.7 against 27.5 s). GPUs choose their own layouts.
    qh = jnp.transpose(q.reshape(b, n, hkv, hq // hkv, d), (0, 2, 3, 1, 4))  # [B, Hkv, G, L, D]
    kh, vh = (jnp.transpose(x, (0, 2, 1, 3)) for x in (k, v))  # [B, Hkv, S, D]
    logits = jnp.einsum("bkgld,bksd->bkgls", qh, kh, preferred_element_type=jnp.float32,
                        precision=precision) * scale  # [B, Hkv, G, L, S]
    allowed = combined_mask(key_mask, mask, kv_len, n, k.shape[1])
    if allowed is not None:
        logits = jnp.where(allowed[:, :, None], logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bkgls,bksd->bkgld", probs.astype(v.dtype), vh, preferred_element_type=jnp.float32,
                     precision=precision)
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, n, hq, d).astype(q.dtype)


# Query rows per chunk of the "xla" backend on a CPU. Streaming [.., L, S] fp32 logits through memory is what
# long rows cost there; a chunk's [.., C, S] logits stay in cache (2-core machine, bf16, head-major
# `xla_attention`: 208 ms a layer at [10, 1030] in chunks of 128 against 226 ms in one pass; 128 beats 256 and
# 512). A GPU keeps one pass: there the chunks would run one after another.
CPU_QUERY_CHUNK = 128
# Under a mask (SDAR's block-causal prefill) a query chunk often sees only a prefix of the keys: from this many
# keys on, each chunk attends to the shortest of KEY_BUCKETS static prefixes that holds every key its rows may
# see: about 3/8 of a causal mask's work skipped (10 samples of tiny-sdar-long at 4k on 2 cores: 48 s against 62 s
# without; 8 prefixes take 49 s and compile more programs).
KEY_BUCKETS = 4
KEY_BUCKET_MIN_KEYS = 2048


def query_chunked_attention(q, k, v, *, key_mask=None, mask=None, kv_len=None, scale=None,
                            chunk: int = CPU_QUERY_CHUNK, key_buckets: int | None = None):
    """`xla_attention` in `lax.map` over query chunks of at most `chunk` rows (as equal as the length
    allows; the last is padded with hidden rows that are dropped): the same rows, each with all its
    keys, so the same softmax per row. One chunk for L <= chunk.

    key_buckets: a chunk attends to the shortest of this many equal static key prefixes (the last: all
    S keys) that holds every key its rows may see; keys past it are hidden from all its rows, so each
    row's softmax is unchanged (a row that sees no key keeps its uniform softmax over all S: such a
    chunk takes every key). Default: KEY_BUCKETS under a `mask` with S >= KEY_BUCKET_MIN_KEYS, else 1.
    """
    b, n, hq, d = q.shape
    s = k.shape[1]
    if key_buckets is None:
        key_buckets = KEY_BUCKETS if mask is not None and s >= KEY_BUCKET_MIN_KEYS else 1
    count = -(-n // chunk)
    if count == 1 and key_buckets == 1:
        return xla_attention(q, k, v, key_mask=key_mask, mask=mask, kv_len=kv_len, scale=scale)
    size = -(-n // count)
    pad = count * size - n
    q_chunks = jnp.moveaxis(jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, count, size, hq, d), 1, 0)
    real_rows = (jnp.arange(count * size) < n).reshape(count, size)
    mask_chunks = None
    if mask is not None:
        lead = mask.shape[:-2]
        padded = jnp.pad(mask, [(0, 0)] * len(lead) + [(0, pad), (0, 0)])
        mask_chunks = jnp.moveaxis(padded.reshape(*lead, count, size, mask.shape[-1]), len(lead), 0)
    lengths = sorted({-(-s * (i + 1) // key_buckets) for i in range(key_buckets)})

    def prefix(length):
        def attend(inputs):
            q_chunk, mask_chunk = inputs
            return xla_attention(q_chunk, k[:, :length], v[:, :length],
                                 key_mask=None if key_mask is None else key_mask[:, :length],
                                 mask=None if mask_chunk is None else mask_chunk[..., :length], kv_len=kv_len,
                                 scale=scale)
        return attend

    def one(chunk_inputs):
        q_chunk, mask_chunk, rows = chunk_inputs
        if len(lengths) == 1:
            return prefix(s)((q_chunk, mask_chunk))
        allowed = combined_mask(key_mask, mask_chunk, kv_len, size, s)  # [B|1, 1, C, S]
        if allowed is None:  # nothing hidden: every key
            return prefix(s)((q_chunk, mask_chunk))
        seen = jnp.max(jnp.where(allowed, jnp.arange(1, s + 1), 0), axis=-1)  # last key seen + 1, per row
        blind = jnp.any((seen == 0) & rows)  # a real row that sees nothing: its uniform softmax spans all S
        needed = jnp.where(blind, s, jnp.max(seen))
        bucket = jnp.searchsorted(jnp.asarray(lengths), needed)
        return jax.lax.switch(bucket, [prefix(length) for length in lengths], (q_chunk, mask_chunk))

    out = jax.lax.map(one, (q_chunks, mask_chunks, real_rows))  # [count, B, size, Hq, D]
    return jnp.moveaxis(out, 0, 1).reshape(b, count * size, hq, d)[:, :n]


# The backends this function implements itself (the Pallas ones go through `kernels.attention`).
DENSE_BACKENDS = ("auto", "reference", "xla", "cudnn")


def dense_attention(q, k, v, *, key_mask=None, mask=None, kv_len=None, scale=None, backend="auto"):
    """Softmax attention of every query over the keys it may see (bidirectional unless `mask` says).

    Args:
      q: [B, L, Hq, D] queries.
      k, v: [B, S, Hkv, D] keys and values.
      key_mask: optional bool [B, S], False for keys no query may attend (padding).
      mask: optional bool [L, S] shared by the batch, or [B, L, S]; True where query i may attend
        key j (e.g. block-causal).
      kv_len: optional int32 scalar or [B]: keys at or beyond it are hidden (a KV cache's fill).
      scale: logit scale, default 1/sqrt(D).
      backend: "auto" (`backends.dense_default`: cuDNN on a GPU for bf16/fp16, XLA otherwise),
        "reference" / "xla" (the jnp `xla_attention`; "xla" on a CPU in query chunks,
        `query_chunked_attention`) or "cudnn" (names of `dllm_jax.attention.backends`; the Pallas kernels
        are reached through `Dense(backend=...)`).
    Returns:
      [B, L, Hq, D] in q's dtype.
    """
    scale = pk.check_scale(scale)  # the kernels' rule: NaN, Inf, <= 0, bools and strings refused
    backends.check(backend, "dense_attention backend", DENSE_BACKENDS)
    if backend == "auto":
        backend = backends.dense_default(q.dtype, q.shape[-1])
    if backend == "xla" and backends.platform() == "cpu":
        return query_chunked_attention(q, k, v, key_mask=key_mask, mask=mask, kv_len=kv_len, scale=scale)
    if backend in ("reference", "xla"):
        return xla_attention(q, k, v, key_mask=key_mask, mask=mask, kv_len=kv_len, scale=scale)
    b, n, s = q.shape[0], q.shape[1], k.shape[1]
    seq_lengths = None
    if kv_len is not None and key_mask is None and mask is None:
        # a fill length alone is cuDNN's right-padding mode: no [B, 1, L, S] bias to build
        seq_lengths = jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (b,))
        kv_len = None
    # cuDNN takes other masks only as a full [B, 1, L, S] bias (it rejects broadcast axes).
    allowed = combined_mask(key_mask, mask, kv_len, n, s)
    if allowed is not None:
        allowed = jnp.broadcast_to(allowed, (b, 1, n, s))
    return jax.nn.dot_product_attention(q, k, v, mask=allowed, scale=scale, key_value_seq_lengths=seq_lengths,
                                        implementation="cudnn")
