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

Batched rows may sit at different positions (`kv_len` int32 [B]) and be in different modes: with
`unmasked` per row, `block_mode` gives int32 [B] (tau applies per row), and `attend` runs each mode's
branch only if some row needs it (`policy.switch_rows`). Rows that wait for the others get SPARSE,
which leaves their cached part unchanged.
"""

from __future__ import annotations

import dataclasses
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from dllm_jax import validation
from dllm_jax.attention import kernels
from dllm_jax.attention.mage import MAGE, block_keys, prefix_counts, row_lengths, selected_attention
from dllm_jax.attention.policy import AttentionPolicy, Mode, check_backend, check_field, switch_rows


def complement_indices(indices, prefix_len, capacity: int):
    """The prefix positions a selection leaves out, per KV head: (int32 [B, Hkv, capacity] ascending,
    padded with zeros, int32 counts [B, Hkv]).

    indices [B, Hkv, k]: `select_prefix`'s output (its first min(k, prefix_len[b]) entries are
    distinct prefix positions; the rest repeat the last one); prefix_len: int scalar or int32 [B].
    """
    b, h, k = indices.shape
    prefix_len = row_lengths(prefix_len, b)[:, None, None]
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

    def __post_init__(self):
        # tau meets the int32 count of unmasked tokens; None: refresh only at step 0
        check_field(self, "tau", validation.integer, optional=True, minimum=0, maximum=validation.INT32_MAX)
        if self.inner is not None and not isinstance(self.inner, MAGE):
            raise ValueError(f"FlashBlock.inner must be a MAGE config or None, got {self.inner!r} "
                             f"({type(self.inner).__name__})")
        check_backend(self)

    def init_state(self, *, batch, num_heads, num_kv_heads, q_len, kv_len, head_dim):
        inner = () if self.inner is None else self.inner.init_state(
            batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads, q_len=q_len, kv_len=kv_len,
            head_dim=head_dim)
        cached_o = jnp.zeros((batch, q_len, num_heads, head_dim), jnp.float32)
        cached_lse = jnp.full((batch, num_heads, q_len), -jnp.inf, jnp.float32)
        return inner, cached_o, cached_lse

    def state_partition(self):
        inner = () if self.inner is None else self.inner.state_partition()
        return inner, P("dp", "sp", "tp", None), P("dp", "tp", "sp")  # (inner, cached_o, cached_lse)

    def stack_layers(self, states):
        inner, cached_o, cached_lse = states
        if self.inner is not None:
            inner = self.inner.stack_layers(inner)
        return inner, cached_o, cached_lse

    def mode(self, step):
        raise ValueError("FlashBlock schedules its steps from the block's progress (block_mode): it runs in "
                         "SDAR block-diffusion generation, not on LLaDA")

    def block_mode(self, step, *, unmasked, commit):
        """int32 [B] when `unmasked` (or step, or commit) is per row (tau applies per row), else a scalar."""
        reuse = (step > 0) & (jnp.asarray(unmasked) < self.tau if self.tau is not None else True)
        mode = jnp.where(commit, int(Mode.DENSE), jnp.where(step == 0, int(Mode.ESTIMATE),
                                                             jnp.where(reuse, int(Mode.SPARSE), int(Mode.REFRESH))))
        return jnp.broadcast_to(mode, jnp.broadcast_shapes(mode.shape, jnp.shape(unmasked))).astype(jnp.int32)

    def attend(self, q, k, v, state, mode, *, kv_len=None, **masks):
        """k, v: one layer's cache [B, S, Hkv, D]; kv_len: int scalar or int32 [B]; mode: int32 scalar
        or [B] (per row: each branch runs only if some row needs it, see `switch_rows`; SPARSE leaves
        a row's state unchanged)."""
        kernels.check_masks("FlashBlock", masks)
        if kv_len is None:
            raise ValueError("FlashBlock attends a query block against a KV cache: it needs kv_len (SDAR block steps)")
        inner, cached_o, cached_lse = state
        n = q.shape[1]
        kv_len = row_lengths(kv_len, q.shape[0])
        prefix = kv_len - n
        mode = jnp.asarray(mode)

        if self.inner is None:
            # branches return (out, cached_o, cached_lse): every leaf batch-first, as switch_rows needs
            def exact(_):
                return kernels.split_kv(q, k, v, kv_len, self.backend)[0], cached_o, cached_lse

            def internal():
                k_block, v_block = block_keys(k, v, kv_len, n)
                return kernels.flash(q, k_block, v_block, self.backend)

            def refresh(_):
                o_out, lse_out = kernels.split_kv(q, k, v, prefix, self.backend)
                out, _ = pk.merge_attention(o_out, lse_out, *internal())
                return out.astype(q.dtype), o_out.astype(jnp.float32), lse_out

            def reuse(_):
                out, _ = pk.merge_attention(cached_o, cached_lse, *internal())
                return out.astype(q.dtype), cached_o, cached_lse

            branch = jnp.where(mode == int(Mode.DENSE), 0, jnp.where(mode == int(Mode.SPARSE), 2, 1))
            out, cached_o, cached_lse = switch_rows(branch, [exact, refresh, reuse], None)
            return out, (inner, cached_o, cached_lse)

        mage = self.inner
        selection, exact_layer = inner

        def residual(selection):
            """(o, lse) over the prefix keys the selection leaves out."""
            left_out, counts = complement_indices(selection.indices, prefix, k.shape[-3])
            return kernels.split_kv_gather(q, k, v, left_out, counts, self.backend)

        # branches return (out, selection, cached_o, cached_lse): every leaf batch-first
        def exact(_):
            return kernels.split_kv(q, k, v, kv_len, self.backend)[0], selection, cached_o, cached_lse

        def estimate(_):
            out, selected = mage.estimate(q, k, v, kv_len)
            o_res, lse_res = residual(selected)
            return out.astype(q.dtype), selected, o_res.astype(jnp.float32), lse_res

        def refresh(_):
            o_res, lse_res = residual(selection)
            out, _ = pk.merge_attention(*selected_attention(q, k, v, selection, self.backend), o_res, lse_res)
            return out.astype(q.dtype), selection, o_res.astype(jnp.float32), lse_res

        def reuse(_):
            out, _ = pk.merge_attention(*selected_attention(q, k, v, selection, self.backend), cached_o, cached_lse)
            return out.astype(q.dtype), selection, cached_o, cached_lse

        branch = jnp.select([mode == int(Mode.ESTIMATE), mode == int(Mode.REFRESH), mode == int(Mode.SPARSE)],
                            [1, 2, 3], 0)
        out, selection, cached_o, cached_lse = switch_rows(jnp.where(exact_layer, 0, branch),
                                                           [exact, estimate, refresh, reuse], None)
        return out, ((selection, exact_layer), cached_o, cached_lse)

    def selection(self, state):
        """MAGE's (indices, exact) when combined; None for FlashBlock alone (it selects nothing)."""
        return None if self.inner is None else self.inner.selection(state[0])
