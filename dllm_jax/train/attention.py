"""Training attention without [L, L] memory: exact softmax attention whose masks are built per query
chunk from positions, never as an [L, L] array (or SDAR's [2L, 2L] two-copy mask), with each chunk's
backward recomputing it (`jax.checkpoint`) instead of storing its scores.

Every chunk attends through `dllm_jax.attention.dense.dense_attention` (its backend resolved as usual:
cuDNN's flash attention on a GPU in bf16, XLA elsewhere), so the numerics are the model's own:

  * LLaDA (`padded_attention`): bidirectional, each row's pad keys hidden. On cuDNN this is one call
    with key lengths (right padding: no mask at all, flash memory); on XLA, query chunks against every
    key with the [B, chunk, L] part of the key mask.
  * SDAR (`two_copy_attention`, BD3-LM's [x_t ; x_0], `losses.two_copy_mask`'s rule): a chunk of whole
    blocks of one copy attends, in one softmax, to the clean keys of earlier blocks and to its own
    copy's keys inside the chunk (its own blocks), under a [chunk, L + chunk] mask; about half of the
    clean keys are masked for the average chunk, the price of one static shape for every chunk
    (`lax.map`) rather than a program per chunk.

Measured on an H100 (benchmarks/results/train_attention_*.md) against the materialised masks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dllm_jax.attention import backends
from dllm_jax.attention.dense import dense_attention

CHUNK = 2048  # queries per chunk: enough rows to fill a GPU; a chunk's [B, 1, chunk, L] mask at 32k, B = 2: 256 MiB


def chunk_size(length: int, chunk: int, multiple: int = 1) -> int:
    """The chunk used for `length` queries: `chunk` rounded down to a multiple of `multiple` (SDAR's block),
    at most `length` rounded up to that multiple."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    whole = -(-length // multiple) * multiple
    return min(whole, max(multiple, chunk // multiple * multiple))


def split_chunks(x, padded: int, chunk: int):
    """x [B, L, H, D] padded to `padded` rows and split: [padded // chunk, B, chunk, H, D]."""
    b, n, h, d = x.shape
    x = jnp.pad(x, ((0, 0), (0, padded - n), (0, 0), (0, 0)))
    return x.reshape(b, padded // chunk, chunk, h, d).transpose(1, 0, 2, 3, 4)


def join_chunks(x, n: int):
    """[chunks, B, chunk, H, D] -> [B, n, H, D] (the padding rows dropped)."""
    chunks, b, c, h, d = x.shape
    return x.transpose(1, 0, 2, 3, 4).reshape(b, chunks * c, h, d)[:, :n]


def padded_attention(q, k, v, lengths, *, chunk: int = CHUNK):
    """Bidirectional attention of q [B, L, Hq, D] over k/v [B, L, Hkv, D] with each row's keys at or
    beyond lengths int32 [B] hidden (LLaDA's training forward, `padding="mask"`)."""
    b, n, _, d = q.shape
    if backends.dense_default(q.dtype, d) == "cudnn":  # key lengths are cuDNN's right padding: no mask
        return dense_attention(q, k, v, kv_len=lengths, backend="cudnn")
    c = chunk_size(n, chunk)

    @jax.checkpoint
    def one(qc):
        return dense_attention(qc, k, v, kv_len=lengths, backend="xla")

    return join_chunks(jax.lax.map(one, split_chunks(q, -(-n // c) * c, c)), n)


def two_copy_attention(q, k, v, *, block_size: int, chunk: int = CHUNK):
    """Attention over SDAR's two copies q/k/v [B, 2L, H, D] = [x_t ; x_0] (both at positions 0..L-1)
    under `losses.two_copy_mask`'s rule, without that [2L, 2L] mask: a query of block b sees the clean
    keys of blocks < b and the keys of block b of its own copy."""
    length = q.shape[1] // 2
    c = chunk_size(length, chunk, block_size)
    padded = -(-length // c) * c

    def copies(x):  # [B, 2L, H, D] -> each copy padded to whole chunks, side by side: [B, 2 * padded, H, D]
        pad = ((0, 0), (0, padded - length), (0, 0), (0, 0))
        return jnp.concatenate([jnp.pad(x[:, :length], pad), jnp.pad(x[:, length:], pad)], axis=1)

    kp, vp = copies(k), copies(v)
    clean_k, clean_v = k[:, length:], v[:, length:]
    clean_block = jnp.arange(length) // block_size
    starts = jnp.arange(2 * padded // c) * c

    @jax.checkpoint
    def one(args):
        qc, start = args
        position = (start + jnp.arange(c)) % padded  # of each query, and of each of the chunk's own keys
        block = position // block_size
        earlier = clean_block[None, :] < block[:, None]  # [C, L]: the clean context before the block
        own = (block[None, :] == block[:, None]) & (position[None, :] < length)  # [C, C]: its own blocks
        keys = jnp.concatenate([clean_k, jax.lax.dynamic_slice_in_dim(kp, start, c, axis=1)], axis=1)
        values = jnp.concatenate([clean_v, jax.lax.dynamic_slice_in_dim(vp, start, c, axis=1)], axis=1)
        return dense_attention(qc, keys, values, mask=jnp.concatenate([earlier, own], axis=1))

    out = join_chunks(jax.lax.map(one, (split_chunks(copies(q), 2 * padded, c), starts)), 2 * padded)
    return jnp.concatenate([out[:, :length], out[:, padded:padded + length]], axis=1)
