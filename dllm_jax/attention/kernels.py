"""How attention policies reach the Pallas kernels: the entry layer where a policy's `backend`
(the vocabulary of `dllm_jax.attention.backends`) is resolved, once per operation, into the concrete
code that runs; the `pallas_kernels` entry points get that concrete choice ("triton" or "mosaic",
with `interpret=True` for "interpret") and never "auto".
"""

from __future__ import annotations

import jax.numpy as jnp

import pallas_kernels as pk
from dllm_jax.attention import backends, kv_rows
from dllm_jax.attention.dense import dense_attention

# the kernels that have a Mosaic GPU version and so take a `backend` argument of their own
_MOSAIC_KERNELS = (pk.flash_attention, pk.block_sparse_attention)


def check_backend(backend: str, name: str = "backend") -> None:
    """A sparse method's backend (`backends.METHOD_BACKENDS`): ValueError naming `name` otherwise."""
    backends.check(backend, name, backends.METHOD_BACKENDS)


def run(kernel, reference, which: str, *args, **kwargs):
    """`kernel(*args, **kwargs)` or `reference(...)` for a resolved choice `which` ('reference',
    'triton', 'mosaic' or 'interpret'): the kernel entry is told exactly what to run."""
    if which == "reference":
        return reference(*args, **kwargs)
    if kernel in _MOSAIC_KERNELS:
        kwargs["backend"] = "mosaic" if which == "mosaic" else "triton"
    return kernel(*args, interpret=which == "interpret", **kwargs)


def call(kernel, reference, backend: str, *args, **kwargs):
    """`kernel(*args, **kwargs)` or `reference(...)` as `backend` resolves for these inputs (args[0]
    is the queries; `block_q` / `block_kv` are the pattern's blocks where the kernel takes them)."""
    which = backends.kernel(backend, args[0], mosaic_kernel=kernel in _MOSAIC_KERNELS, scale=kwargs.get("scale"),
                            block_q=kwargs.get("block_q"), block_kv=kwargs.get("block_kv"),
                            name=getattr(kernel, "__name__", "kernel"))
    return run(kernel, reference, which, *args, **kwargs)


def attention(q, k, v, backend: str, *, key_mask=None, mask=None, kv_len=None, scale=None):
    """Dense attention of every query over the keys the masks leave (as `dense_attention` takes
    them) by the code `backends.dense` resolves: `dense_attention` (cuDNN or XLA), the split-KV
    kernel or the flash kernel. Returns out [B, L, Hq, D]."""
    op, which = backends.dense(backend, q, k, kv_len=kv_len, key_mask=key_mask, mask=mask)
    if isinstance(k, kv_rows.QuantizedRows):  # a float8 cache: the split-KV kernel reads it as it is
        if op == "split_kv":
            return run(pk.split_kv_attention, pk.split_kv_attention_reference, which, q, k.data, v.data,
                       kv_len=kv_len, scale=scale, k_scale=k.scale, v_scale=v.scale)
        k, v = kv_rows.dense_rows(k, q.dtype), kv_rows.dense_rows(v, q.dtype)
        op, which = backends.dense(backend, q, k, kv_len=kv_len, key_mask=key_mask, mask=mask)
    if op != "split_kv" and kv_len is not None and jnp.ndim(kv_len) == 2:
        # a fill length per query [B, L] (`AttentionPolicy.joins_segments`) only the split-KV kernel takes: the
        # others get it as the block mask it is
        per_query = jnp.arange(k.shape[1]) < jnp.asarray(kv_len, jnp.int32)[..., None]
        mask = per_query if mask is None else mask & per_query
        op, which = backends.dense(backend, q, k, key_mask=key_mask, mask=mask)
        kv_len = None
    if op == "split_kv":
        return run(pk.split_kv_attention, pk.split_kv_attention_reference, which, q, k, v, kv_len=kv_len, scale=scale)
    if op == "flash":
        return run(pk.flash_attention, pk.flash_attention_reference, which, q, k, v, kv_len=kv_len, scale=scale)
    return dense_attention(q, k, v, key_mask=key_mask, mask=mask, kv_len=kv_len, scale=scale, backend=which)


def runs_block_mass(q, block: int, scale, backend: str) -> bool:
    """Whether SparseD's estimation can run fused (`block_mass`): the Mosaic kernel is what the
    backend runs here and it takes these inputs with key tiles of `block` ("mosaic": a ValueError
    naming why where it cannot)."""
    return backends.kernel(backend, q, mosaic_kernel=True, scale=scale, block_kv=block,
                           name="SparseD estimation") == "mosaic"


def block_mass(q, k, v, block: int, scale, backend: str):
    """(o, lse, mass): attention with each query's log-mass per key tile of `block` (one pass; the
    kernel is Mosaic-only, so callers ask `runs_block_mass` first)."""
    which = backends.kernel(backend, q, mosaic_kernel=True, scale=scale, block_kv=block, name="flash_block_mass")
    return run(pk.flash_block_mass, pk.flash_block_mass_reference, which, q, k, v, block_kv=block, scale=scale)


def dense(q, k, v, backend: str):
    """A method's dense steps: unmasked attention by its own backend (under "auto" the same code as
    dense generation, cuDNN on a GPU; "reference" the jnp attention)."""
    return attention(q, k, v, backend)


def flash_lse(q, k, scale, backend: str):
    """The natural-log LSE f32 [B, Hq, Nq] of softmax(scale * q k^T) (v = k: only the LSE is used)."""
    _, lse = call(pk.flash_attention, pk.flash_attention_reference, backend, q, k, k, scale=scale, return_lse=True)
    return lse


def block_scores(q, k, block: int, scale, backend: str):
    """SparseD's pooled probabilities [B, Hq, ceil(Nq/block), ceil(Nk/block)] (exact softmax)."""
    lse = flash_lse(q, k, scale, backend)
    return call(pk.block_scores, pk.block_scores_reference, backend, q, k, lse, block_q=block, block_kv=block,
                scale=scale)


def column_scores(q, k, group: int, scale, backend: str):
    """PulseCol's mean probability per (query group, key) [B, Hq, ceil(Nq/group), Nk]."""
    lse = flash_lse(q, k, scale, backend)
    return call(pk.column_scores, pk.column_scores_reference, backend, q, k, lse, group_size=group, scale=scale)


def split_kv(q, k, v, kv_len, backend: str, scale=None, *, return_logits: bool = False, return_probs: bool = False):
    """Dense attention of a query block over one layer's KV cache [B, S, Hkv, D] below kv_len: (o, lse), and
    with return_logits the pass's scaled logits f32 [B, Hkv, G * Nq, S], with return_probs their float16 form
    (probs, tile_max) (`pk.split_kv_attention`'s layouts)."""
    return call(pk.split_kv_attention, pk.split_kv_attention_reference, backend, q, k, v, kv_len=kv_len,
                scale=scale, return_lse=True, return_logits=return_logits, return_probs=return_probs)


def split_kv_gather(q, k, v, indices, counts, backend: str):
    """Attention of a query block over per-KV-head listed cache rows: (o, lse)."""
    return call(pk.split_kv_gather_attention, pk.split_kv_gather_attention_reference, backend, q, k, v, indices,
                counts, return_lse=True)


def kv_scores(q, k, lse, kv_len, backend: str, scale=None):
    """MAGE's mean probability per cache key over the block's queries and GQA group [B, Hkv, S]."""
    return call(pk.kv_scores, pk.kv_scores_reference, backend, q, k, lse, kv_len=kv_len, scale=scale)


def kv_scores_from_logits(logits, lse, kv_len, backend: str):
    """`kv_scores` from the logits of a split-KV pass (`split_kv(..., return_logits=True)`) and its LSE [B, Hkv, S]."""
    return call(pk.kv_scores_from_logits, pk.kv_scores_from_logits_reference, backend, logits, lse, kv_len=kv_len)


def kv_scores_from_probs(probs, tile_max, lse, kv_len, backend: str):
    """`kv_scores` from the float16 form of a split-KV pass's logits (`split_kv(..., return_probs=True)`)."""
    return call(pk.kv_scores_from_probs, pk.kv_scores_from_probs_reference, backend, probs, tile_max, lse,
                kv_len=kv_len)


def flash(q, k, v, backend: str):
    """Dense attention with its LSE: (o, lse)."""
    return call(pk.flash_attention, pk.flash_attention_reference, backend, q, k, v, return_lse=True)


def check_masks(method: str, masks: dict) -> None:
    """The published methods run on unpadded sequences (the official code ignores padding)."""
    given = sorted(name for name, value in masks.items() if value is not None)
    if given:
        raise ValueError(f"{method} does not support attention masks ({given}); generate with "
                         "padding='ignore' (the official behaviour) or without padding")
