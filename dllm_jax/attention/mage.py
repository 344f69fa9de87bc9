"""MAGE ([MASK]-guided sparse attention, arXiv 2602.14209 v2; no public code, papers/mage.md and
docs/methods.md §3) as an attention policy for SDAR block diffusion.

Step 1 of each block (its tokens are all [MASK]) attends exactly over the cache prefix plus the
block, as two parts merged by LSE (the N prefix keys, then the block's own keys), and, per layer
and KV head, keeps the top-k prefix positions by the paper's Eq. 3 (`select_prefix`):

    score_i = 1/(G B) sum_{g in group(h)} sum_{q in block} softmax_i(Q K_prefix^T / sqrt(d))[g, q],

the softmax taken over the N prefix keys only (A in R^{G x B x N}). The prefix part's LSE is what
that softmax needs, so the selection costs no extra attention pass. `softmax_over="prefix+block"`
keeps this project's earlier rule (the softmax over prefix + block keys, i.e. each query weighted
by its attention mass on the prefix); the two rankings differ when queries split their mass
unevenly between prefix and block.
Steps 2..T of the block attend to those k prefix entries (gathered split-KV kernel) plus the whole
current block, merged by LSE. Layers below `exact_layers` stay exact; a prefix of at most k
positions is kept whole, so attention is then exact too.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from dllm_jax.attention import kernels
from dllm_jax.attention.policy import AttentionPolicy, Mode


SOFTMAX_OVER = ("prefix", "prefix+block")  # Eq. 3 (the default); this project's earlier rule


def check_softmax_over(softmax_over: str) -> None:
    if softmax_over not in SOFTMAX_OVER:
        raise ValueError(f"softmax_over={softmax_over!r} is not one of {SOFTMAX_OVER}")


def select_prefix(q_block, k_cache, *, prefix_len, k: int, scale=None, backend: str = "auto", lse=None,
                  layer=None, softmax_over: str = "prefix"):
    """MAGE's selection: int32 [B, Hkv, k], ascending.

    q_block [B, n, Hq, D]; k_cache [B, S, Hkv, D] holding the committed prefix in [0, prefix_len)
    and the block's own keys in [prefix_len, prefix_len + n), as SDAR's cache does during a block
    step. Each prefix position is scored by its softmax probability averaged over the G query heads
    of its KV head and the n queries; the softmax runs over the prefix_len prefix keys (the paper's
    Eq. 3, softmax_over="prefix") or over all prefix_len + n keys ("prefix+block"); only prefix
    positions are ranked. With fewer than k prefix positions all of them are returned, padded by
    repeating the last (the valid count is `min(k, prefix_len)`, see `prefix_counts`). `lse` f32
    [B, Hq, n]: the LSE of the queries over the keys the softmax runs over, if the caller already
    has it (MAGE's first step does: its prefix part). With `layer`, k_cache is a stacked cache
    [L, B, S, Hkv, D] and that layer is scored.
    """
    check_softmax_over(softmax_over)
    n = q_block.shape[1]
    kv_len = jnp.asarray(prefix_len) + (n if softmax_over == "prefix+block" else 0)
    if lse is None:  # only the LSE is used
        _, lse = kernels.split_kv(q_block, k_cache, k_cache, kv_len, backend, scale, layer=layer)
    # once per block: the score kernel reads one layer's copy
    scores = kernels.kv_scores(q_block, kernels.cache_layer_of(k_cache, layer), lse, kv_len, backend, scale)
    in_prefix = jnp.arange(scores.shape[-1]) < prefix_len
    ranked_scores = jnp.where(in_prefix, scores, -jnp.inf)
    if k > ranked_scores.shape[-1]:  # k beyond the cache capacity: every prefix position is kept
        ranked_scores = jnp.pad(ranked_scores, ((0, 0), (0, 0), (0, k - ranked_scores.shape[-1])),
                                constant_values=-jnp.inf)
    _, idx = jax.lax.top_k(ranked_scores, k)
    count = prefix_counts(prefix_len, k)
    # the first `count` picks are prefix positions; order them and repeat the last one after them
    ranked = jnp.where(jnp.arange(k) < count, idx, jnp.iinfo(jnp.int32).max)
    ordered = jnp.sort(ranked, axis=-1)
    last = jnp.take_along_axis(ordered, jnp.maximum(count - 1, 0) * jnp.ones_like(ordered[..., :1]), axis=-1)
    return jnp.where(jnp.arange(k) < count, ordered, jnp.where(count > 0, last, 0)).astype(jnp.int32)


def prefix_counts(prefix_len, k: int):
    return jnp.minimum(jnp.asarray(prefix_len, jnp.int32), k)


def block_keys(k, v, kv_len, n: int, layer=None):
    """The current block's own keys and values: cache rows [kv_len - n, kv_len) (of `layer` when k
    and v are a stacked cache)."""
    start = kv_len - n
    if layer is not None:
        return tuple(jax.lax.dynamic_slice(x, (layer, 0, start, 0, 0), (1, x.shape[1], n, *x.shape[3:]))[0]
                     for x in (k, v))
    return (jax.lax.dynamic_slice_in_dim(k, start, n, axis=1), jax.lax.dynamic_slice_in_dim(v, start, n, axis=1))


def selected_attention(q, k, v, indices, kv_len, backend: str, layer=None):
    """(o, lse) over the selected prefix rows `indices` [B, Hkv, k] plus the whole current block."""
    n = q.shape[1]
    counts = jnp.broadcast_to(prefix_counts(kv_len - n, indices.shape[-1]), indices.shape[:2])
    o_prefix, lse_prefix = kernels.split_kv_gather(q, k, v, indices, counts, backend, layer=layer)
    k_block, v_block = block_keys(k, v, kv_len, n, layer)
    o_block, lse_block = kernels.flash(q, k_block, v_block, backend)
    return pk.merge_attention(o_prefix, lse_prefix, o_block, lse_block)


def split_exact_attention(q, k, v, kv_len, backend: str, layer=None):
    """Exact attention of a block step as its prefix part and its block part merged by LSE:
    (o, lse over prefix + block, prefix_lse over the prefix alone, what Eq. 3's softmax needs)."""
    n = q.shape[1]
    o_prefix, prefix_lse = kernels.split_kv(q, k, v, kv_len - n, backend, layer=layer)
    k_block, v_block = block_keys(k, v, kv_len, n, layer)
    o, lse = pk.merge_attention(o_prefix, prefix_lse, *kernels.flash(q, k_block, v_block, backend))
    return o, lse, prefix_lse


@dataclasses.dataclass(frozen=True, kw_only=True)
class MAGE(AttentionPolicy):
    """MAGE's configuration.

    k: prefix positions kept per (layer, KV head) (256, 512 or 1024 in the paper; 512 by default).
    exact_layers: the first layers that always attend exactly (2).
    softmax_over: "prefix" (the paper's Eq. 3: the selection's softmax over the prefix keys alone)
      or "prefix+block" (this project's earlier rule: over the prefix and the block's keys).
    backend: as SparseD's ("auto": Pallas on GPU, references elsewhere).
    """

    k: int = 512
    exact_layers: int = 2
    softmax_over: str = "prefix"
    backend: str = "auto"
    reads_stacked_cache: ClassVar[bool] = True  # SDAR passes the whole cache and cache_layer

    def __post_init__(self):
        if self.k < 1 or self.exact_layers < 0:
            raise ValueError(f"MAGE needs k >= 1 and exact_layers >= 0, got k={self.k}, "
                             f"exact_layers={self.exact_layers}")
        check_softmax_over(self.softmax_over)
        kernels.check_backend(self.backend)

    def init_state(self, *, batch, num_heads, num_kv_heads, q_len, kv_len, head_dim):
        return jnp.zeros((batch, num_kv_heads, self.k), jnp.int32), jnp.zeros((), bool)

    def stack_layers(self, states):
        indices, exact = states
        return indices, jnp.arange(exact.shape[0]) < self.exact_layers

    def mode(self, step):
        return jnp.where(step == 0, int(Mode.ESTIMATE), int(Mode.SPARSE))  # step: within the block

    def attend(self, q, k, v, state, mode, *, kv_len=None, cache_layer=None, **masks):
        """k, v: one layer's cache [B, S, Hkv, D], or the stacked cache [L, B, S, Hkv, D] with
        `cache_layer` (read in place by the kernels)."""
        kernels.check_masks("MAGE", masks)
        if kv_len is None:
            raise ValueError("MAGE attends a query block against a KV cache: it needs kv_len (SDAR block steps)")
        indices, exact = state
        layer = cache_layer

        def exact_step(_):
            return kernels.split_kv(q, k, v, kv_len, self.backend, layer=layer)[0], indices

        def estimate(_):
            out, lse, prefix_lse = split_exact_attention(q, k, v, kv_len, self.backend, layer)
            return out.astype(q.dtype), self.select(q, k, kv_len, lse, layer, prefix_lse=prefix_lse)

        def sparse(_):
            out, _ = selected_attention(q, k, v, indices, kv_len, self.backend, layer)
            return out.astype(q.dtype), indices

        # DENSE (and REFRESH, which has nothing to refresh here) attend exactly
        mode = jnp.asarray(mode)
        branch = jnp.where(mode == int(Mode.ESTIMATE), 1, jnp.where(mode == int(Mode.SPARSE), 2, 0))
        out, indices = jax.lax.switch(jnp.where(exact, 0, branch), [exact_step, estimate, sparse], None)
        return out, (indices, exact)

    def select(self, q, k, kv_len, lse=None, layer=None, *, prefix_lse=None):
        """`select_prefix` for a block step against the whole cache buffer k. `lse` (over prefix + block)
        and `prefix_lse` (over the prefix alone; see `split_exact_attention`) are what the caller
        already has; the one `softmax_over` needs is used, and computed here when not given."""
        given = prefix_lse if self.softmax_over == "prefix" else lse
        return select_prefix(q, k, prefix_len=kv_len - q.shape[1], k=self.k, backend=self.backend, lse=given,
                             layer=layer, softmax_over=self.softmax_over)

    def selection(self, state):
        """(indices [B, Hkv, k], exact) of one layer's state: what `dllm_jax.analysis` compares."""
        return state
