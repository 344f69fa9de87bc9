"""How attention policies reach the Pallas kernels: one backend switch shared by every method.

backend "auto" runs the Pallas kernels on a GPU and their pure-jnp references (same signatures,
same results) elsewhere; "pallas" forces the kernels (each picks Mosaic GPU on Hopper where it has a
Mosaic version, Triton otherwise), "mosaic" insists on the Mosaic kernels where they exist (an error
where the inputs don't fit them), "triton" forces the Triton kernels, "interpret" runs the Triton
kernels in Pallas interpret mode (slow; for tests on CPU), "reference" forces the references.
"""

from __future__ import annotations

import jax

import pallas_kernels as pk
from pallas_kernels import mosaic
from dllm_jax.attention.dense import dense_attention

BACKENDS = ("auto", "pallas", "mosaic", "triton", "interpret", "reference")
# the kernels that have a Mosaic GPU version and so take a `backend` argument of their own
_MOSAIC_KERNELS = (pk.flash_attention, pk.block_sparse_attention)


def check_backend(backend: str, name: str = "backend") -> None:
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{name}={backend!r} is not one of {BACKENDS}")


def resolve(backend: str) -> str:
    if backend == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "reference"
    return backend


def call(kernel, reference, backend: str, *args, **kwargs):
    """`kernel(*args, **kwargs)` or `reference(...)` as the backend says."""
    which = resolve(backend)
    if which == "reference":
        return reference(*args, **kwargs)
    if which in ("mosaic", "triton") and kernel in _MOSAIC_KERNELS:
        kwargs["backend"] = which
    return kernel(*args, interpret=which == "interpret", **kwargs)


def runs_block_mass(q, block: int, scale, backend: str) -> bool:
    """Whether SparseD's estimation can run fused (`block_mass`): the Mosaic kernel is what the
    backend runs here and it takes these inputs with key tiles of `block`."""
    which = resolve(backend)
    if which not in ("pallas", "mosaic"):
        return False
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    return mosaic.choose("mosaic" if which == "mosaic" else "auto", q, scale=scale, interpret=False,
                            triton_knobs=False, name="SparseD estimation", block_kv=block) == "mosaic"


def block_mass(q, k, v, block: int, scale, backend: str):
    """(o, lse, mass): attention with each query's log-mass per key tile of `block` (one pass)."""
    return call(pk.flash_block_mass, pk.flash_block_mass_reference, backend, q, k, v, block_kv=block,
                scale=scale)


def dense(q, k, v, backend: str):
    """The dense steps of a method use the same attention as dense generation (cuDNN on GPU)."""
    del backend
    return dense_attention(q, k, v)


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


def split_kv(q, k, v, kv_len, backend: str, scale=None):
    """Dense attention of a query block over one layer's KV cache [B, S, Hkv, D] below kv_len: (o, lse)."""
    return call(pk.split_kv_attention, pk.split_kv_attention_reference, backend, q, k, v, kv_len=kv_len,
                scale=scale, return_lse=True)


def split_kv_gather(q, k, v, indices, counts, backend: str):
    """Attention of a query block over per-KV-head listed cache rows: (o, lse)."""
    return call(pk.split_kv_gather_attention, pk.split_kv_gather_attention_reference, backend, q, k, v, indices,
                counts, return_lse=True)


def kv_scores(q, k, lse, kv_len, backend: str, scale=None):
    """MAGE's mean probability per cache key over the block's queries and GQA group [B, Hkv, S]."""
    return call(pk.kv_scores, pk.kv_scores_reference, backend, q, k, lse, kv_len=kv_len, scale=scale)


def flash(q, k, v, backend: str):
    """Dense attention with its LSE: (o, lse)."""
    return call(pk.flash_attention, pk.flash_attention_reference, backend, q, k, v, return_lse=True)


def check_masks(method: str, masks: dict) -> None:
    """The published methods run on unpadded sequences (the official code ignores padding)."""
    given = sorted(name for name, value in masks.items() if value is not None)
    if given:
        raise ValueError(f"{method} does not support attention masks ({given}); generate with "
                         "padding='ignore' (the official behaviour) or without padding")
