"""FlashBlock (block-external attention caching, arXiv 2602.05305; official code Caesarhhh/Flash_Block,
docs/methods.md §5) as an attention policy for SDAR block diffusion, alone or around MAGE.

A block step's keys split into the external part (the committed cache prefix) and the internal part
(the current block). Attention over each gives (O, LSE); the two merge exactly by LSE
(`pallas_kernels.merge_attention`). FlashBlock stores the external (O_out, LSE_out) of every layer
at a refresh and, while fewer than `tau` block tokens have been unmasked since, computes only the
internal part and merges it with the stored one, never reading the cache. The stored part is stale:
it was computed with the queries of the refresh step.

Schedule (`block_mode`, the official scheduler's rule):
  step 0 of a block (all [MASK])            ESTIMATE  full attention, store the external part
  later step, unmasked since refresh < tau  SPARSE    internal attention + the stored external part
  later step, unmasked since refresh >= tau REFRESH   full attention, store the external part again
  the commit forward (block finished)       DENSE     full attention, nothing stored
"Unmasked since refresh" counts the tokens the refresh step itself unmasked plus those of the reuse
steps after it. The commit forward writes the block's keys and values to the cache, so it is exact,
as the official engine forces its SAVING step to be. `tau=0` refreshes at every step (exact);
`tau=None` never refreshes after step 0 (the official TRADO_FORCE_DENOISE_NO_UPDATE switch). The
official code updates its count only under `low_confidence_dynamic` remasking; here every
remasking strategy counts the tokens it unmasks, as the paper defines M^{s+1}.

With `inner=MAGE(...)` (the paper's residual reuse, §4.3 and Fig. 6; not in the released code): the
keys MAGE selects at step 0 plus the block are attended exactly at every step, and the prefix keys
it did not select form the cached part: computed at step 0 and at refreshes, merged in at the
other steps. MAGE's exact first layers stay exact at every step.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

import pallas_kernels as pk
from dllm_jax.attention import kernels
from dllm_jax.attention.mage import MAGE, block_keys, prefix_counts, selected_attention, split_exact_attention
from dllm_jax.attention.policy import AttentionPolicy, Mode


def complement_indices(indices, prefix_len, capacity: int):
    """The prefix positions a selection leaves out, per KV head: (int32 [B, Hkv, capacity] ascending,
    padded with zeros, int32 counts [B, Hkv]).

    indices [B, Hkv, k]: `select_prefix`'s output (its first min(k, prefix_len) entries are distinct
    prefix positions; the rest repeat the last one).
    """
    b, h, k = indices.shape
    live = jnp.arange(k) < prefix_counts(prefix_len, k)
    rows = jnp.arange(b)[:, None, None], jnp.arange(h)[None, :, None]
    chosen = jnp.zeros((b, h, capacity), bool).at[(*rows, jnp.where(live, indices, capacity))].set(True, mode="drop")
    left_out = (jnp.arange(capacity) < prefix_len) & ~chosen
    slot = jnp.cumsum(left_out, axis=-1, dtype=jnp.int32) - 1
    positions = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), left_out.shape)
    compact = jnp.zeros((b, h, capacity), jnp.int32).at[(*rows, jnp.where(left_out, slot, capacity))].set(
        positions, mode="drop")
    return compact, jnp.sum(left_out, axis=-1, dtype=jnp.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlashBlock(AttentionPolicy):
    """FlashBlock's configuration.

    tau: refresh once this many block tokens were unmasked since the last refresh (2, the paper's
      default; 0 = always refresh, exact; None = only at each block's first step).
    inner: None, or a MAGE config whose unselected keys become the cached part (residual reuse).
    backend: as MAGE's ("auto": Pallas on GPU, references elsewhere).
    """

    tau: int | None = 2
    inner: MAGE | None = None
    backend: str = "auto"
    reads_stacked_cache: ClassVar[bool] = True  # SDAR passes the whole cache and cache_layer

    def __post_init__(self):
        if self.tau is not None and (not isinstance(self.tau, int) or self.tau < 0):
            raise ValueError(f"FlashBlock needs an int tau >= 0 (or None: refresh only at step 0), got {self.tau!r}")
        if self.inner is not None and not isinstance(self.inner, MAGE):
            raise ValueError(f"FlashBlock(inner=...) takes a MAGE config (or None), got {self.inner!r}")
        kernels.check_backend(self.backend)

    def init_state(self, *, batch, num_heads, num_kv_heads, q_len, kv_len, head_dim):
        inner = () if self.inner is None else self.inner.init_state(
            batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads, q_len=q_len, kv_len=kv_len,
            head_dim=head_dim)
        cached_o = jnp.zeros((batch, q_len, num_heads, head_dim), jnp.float32)
        cached_lse = jnp.full((batch, num_heads, q_len), -jnp.inf, jnp.float32)
        return inner, cached_o, cached_lse

    def stack_layers(self, states):
        inner, cached_o, cached_lse = states
        if self.inner is not None:
            inner = self.inner.stack_layers(inner)
        return inner, cached_o, cached_lse

    def mode(self, step):
        raise ValueError("FlashBlock schedules its steps from the block's progress (block_mode): it runs in "
                         "SDAR block-diffusion generation, not on LLaDA")

    def block_mode(self, step, *, unmasked, commit):
        reuse = step > 0
        if self.tau is not None:
            reuse = reuse & (unmasked < self.tau)
        return jnp.where(commit, int(Mode.DENSE), jnp.where(step == 0, int(Mode.ESTIMATE),
                                                             jnp.where(reuse, int(Mode.SPARSE), int(Mode.REFRESH))))

    def attend(self, q, k, v, state, mode, *, kv_len=None, cache_layer=None, **masks):
        """k, v: one layer's cache [B, S, Hkv, D], or the stacked cache [L, B, S, Hkv, D] with
        `cache_layer` (read in place by the kernels)."""
        kernels.check_masks("FlashBlock", masks)
        if kv_len is None:
            raise ValueError("FlashBlock attends a query block against a KV cache: it needs kv_len (SDAR block steps)")
        inner, cached_o, cached_lse = state
        n, layer = q.shape[1], cache_layer
        mode = jnp.asarray(mode)

        def exact(inner):
            return kernels.split_kv(q, k, v, kv_len, self.backend, layer=layer)[0], inner, cached_o, cached_lse

        if self.inner is None:
            def internal():
                k_block, v_block = block_keys(k, v, kv_len, n, layer)
                return kernels.flash(q, k_block, v_block, self.backend)

            def refresh(inner):
                o_out, lse_out = kernels.split_kv(q, k, v, kv_len - n, self.backend, layer=layer)
                out, _ = pk.merge_attention(o_out, lse_out, *internal())
                return out.astype(q.dtype), inner, o_out.astype(jnp.float32), lse_out

            def reuse(inner):
                out, _ = pk.merge_attention(cached_o, cached_lse, *internal())
                return out.astype(q.dtype), inner, cached_o, cached_lse

            branch = jnp.where(mode == int(Mode.DENSE), 0, jnp.where(mode == int(Mode.SPARSE), 2, 1))
            out, inner, cached_o, cached_lse = jax.lax.switch(branch, [exact, refresh, reuse], inner)
            return out, (inner, cached_o, cached_lse)

        mage = self.inner
        indices, exact_layer = inner

        def residual(indices):
            """(o, lse) over the prefix keys the selection leaves out."""
            left_out, counts = complement_indices(indices, kv_len - n, k.shape[-3])
            return kernels.split_kv_gather(q, k, v, left_out, counts, self.backend, layer=layer)

        def estimate(inner):
            out, lse, prefix_lse = split_exact_attention(q, k, v, kv_len, self.backend, layer)
            indices = mage.select(q, k, kv_len, lse, layer, prefix_lse=prefix_lse)
            out = out.astype(q.dtype)
            o_res, lse_res = residual(indices)
            return out, (indices, exact_layer), o_res.astype(jnp.float32), lse_res

        def refresh(inner):
            o_res, lse_res = residual(indices)
            out, _ = pk.merge_attention(*selected_attention(q, k, v, indices, kv_len, self.backend, layer), o_res,
                                        lse_res)
            return out.astype(q.dtype), inner, o_res.astype(jnp.float32), lse_res

        def reuse(inner):
            out, _ = pk.merge_attention(*selected_attention(q, k, v, indices, kv_len, self.backend, layer),
                                        cached_o, cached_lse)
            return out.astype(q.dtype), inner, cached_o, cached_lse

        branch = jnp.select([mode == int(Mode.ESTIMATE), mode == int(Mode.REFRESH), mode == int(Mode.SPARSE)],
                            [1, 2, 3], 0)
        out, inner, cached_o, cached_lse = jax.lax.switch(jnp.where(exact_layer, 0, branch),
                                                          [exact, estimate, refresh, reuse], inner)
        return out, (inner, cached_o, cached_lse)

    def selection(self, state):
        """MAGE's (indices, exact) when combined; None for FlashBlock alone (it selects nothing)."""
        return None if self.inner is None else state[0]
