"""SparseD (arXiv 2509.24014) as an attention policy for LLaDA, following the official code
(INV-WZQ/SparseD @52155b4, see docs/methods.md §1).

Schedule over the T steps of the whole generation (all semi-AR blocks): end = int(T * skip) + 1;
steps before `end` are dense, step `end` is dense and builds the pattern of every layer (ESTIMATE),
every later step attends through `block_sparse_attention` with it (SPARSE).

Selection (`select_blocks`), per batch row, head and query block of b rows:
  last = first query block starting at or after the prompt end (a boundary block holding prompt and
         generation tokens counts as prefill); nb - 1 if there is none.
  Pass A: P = softmax over all keys; importance = mean of P over each b x b tile (zero padding
          counted); keep the top k_A = floor(nb * select) + 1 blocks, then drop those >= last.
  Pass B: P' = softmax over the generation keys (from last * b) only, pooled the same way; keep the
          top k_B = floor(nb_g * select) + 1 of the nb_g generation blocks.
  Counts are capped at the number of blocks (select = 1.0 keeps everything).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from pallas_kernels._common import mask_to_lists
from dllm_jax import validation
from dllm_jax.attention import kernels
from dllm_jax.attention.policy import (AttentionPolicy, Mode, check_backend, check_field, check_power_of_two,
                                       window_rows)


def _keep(blocks: int, select: float) -> int:
    return min(blocks, max(1, math.floor(blocks * select) + 1))


def boundary_block(length: int, prefill_len: int, block_size: int) -> int:
    """`last`: the first query block that starts at or after the prompt end (nb - 1 if none)."""
    n_blocks = -(-length // block_size)
    return min(-(-prefill_len // block_size), n_blocks - 1)


def pattern_width(length: int, prefill_len: int, block_size: int, select: float) -> int:
    """The static width of SparseD's index rows: at most k_A prefill plus k_B generation blocks."""
    n_blocks = -(-length // block_size)
    gen_blocks = n_blocks - boundary_block(length, prefill_len, block_size)
    return min(n_blocks, _keep(n_blocks, select) + _keep(gen_blocks, select))


def _top_mask(scores, k: int):
    """bool mask of the top-k entries along the last axis (ties to the lower index)."""
    _, idx = jax.lax.top_k(scores, k)
    # a scatter, not a one-hot: [.., k, nb] would be 82G booleans at 64k with 32-blocks
    return jnp.put_along_axis(jnp.zeros(scores.shape, bool), idx, True, axis=-1, inplace=False)


def select_blocks(q, k, *, prefill_len: int, block_size: int, select: float, scale=None, backend: str = "auto"):
    """SparseD's pattern for q [B, Nq, Hq, D] against k [B, N, Hkv, D] (after RoPE): the whole
    sequence's queries (Nq = N), or one device's slice of them under sequence parallelism, whose
    rows are those rows of the whole pattern (the prompt/generation boundary is one of keys).

    Returns (kv_block_indices int32 [B, Hq, ceil(Nq / block_size), width], kv_block_counts int32
    [B, Hq, ceil(Nq / block_size)]) in the format of `pallas_kernels.block_sparse_attention` with
    block_q = block_kv = block_size, where nb = ceil(N / block_size) and width = min(nb, k_A + k_B).
    `scale` defaults to 1/sqrt(D).
    """
    n, d = k.shape[1], q.shape[3]
    last = boundary_block(n, prefill_len, block_size)
    scale = scale if scale is not None else d ** -0.5
    scores = kernels.block_scores(q, k, block_size, scale, backend)  # [B, H, nb, nb]
    gen_scores = kernels.block_scores(q, k[:, last * block_size:], block_size, scale, backend)  # [B, H, nb, nb_g]
    return _pattern(scores, gen_scores, n, prefill_len, block_size, select)


def select_blocks_from_mass(mass, lse, *, prefill_len: int, block_size: int, select: float):
    """`select_blocks`' pattern from `flash_block_mass`'s outputs (key tiles of block_size): the same
    two pooled score passes, without another pass over Q K^T (the generation pass renormalises by
    the LSE over the generation tiles). Queries may be a slice of the sequence's (as `select_blocks`):
    only the number of key tiles matters, so N is taken as a whole number of them."""
    n = mass.shape[2] * block_size
    last = boundary_block(n, prefill_len, block_size)
    scores = pk.pooled_block_scores(mass, lse, block_q=block_size, block_kv=block_size)
    gen_scores = pk.pooled_block_scores(mass[:, :, last:], pk.suffix_lse(mass, last), block_q=block_size,
                                        block_kv=block_size)
    return _pattern(scores, gen_scores, n, prefill_len, block_size, select)


def _pattern(scores, gen_scores, n: int, prefill_len: int, block_size: int, select: float):
    """Pass A's top blocks before `last` joined with pass B's top generation blocks, as index lists."""
    n_blocks = scores.shape[-1]
    last = boundary_block(n, prefill_len, block_size)
    prefill = _top_mask(scores, _keep(n_blocks, select)) & (jnp.arange(n_blocks) < last)
    generation = _top_mask(gen_scores, _keep(n_blocks - last, select))
    chosen = prefill | jnp.pad(generation, ((0, 0), (0, 0), (0, 0), (last, 0)))
    return mask_to_lists(chosen, pattern_width(n, prefill_len, block_size, select))


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparseD(AttentionPolicy):
    """SparseD's configuration; `bind` (called by `generate`) fixes the schedule for a generation.

    skip: fraction of the total steps run dense before the pattern is built (default 0.2).
    select: fraction of key blocks kept per query-block row (rho; 0.3; 1.0 keeps all).
    block_size: pattern block (128 for long contexts, 32 for short; a power of two >= 16).
    scale_quirk: score with 1/sqrt(num_heads) as LLaDA's official code does (attention itself
      always uses 1/sqrt(head_dim)).
    backend: one of `backends.METHOD_BACKENDS`, for every step including the dense ones: "auto"
      (Pallas kernels on GPU, their jnp references elsewhere; dense steps cuDNN on GPU), "reference"
      (pure jnp everywhere), "triton", "mosaic" or "interpret" (Pallas interpret mode; the table in
      `dllm_jax.attention.backends`). Where
      the Mosaic GPU kernel runs (Hopper), the estimation step is one fused pass
      (`flash_block_mass`: output, LSE and per-tile mass) instead of flash + two scoring passes +
      dense attention; the quirk's different scoring scale keeps the unfused path.
    """

    skip: float = 0.2
    select: float = 0.3
    block_size: int = 128
    scale_quirk: bool = False
    backend: str = "auto"
    total_steps: int | None = None
    prefill_len: int | None = None

    def __post_init__(self):
        check_field(self, "skip", validation.real, low=0, high=1, high_open=True)
        check_field(self, "select", validation.real, low=0, high=1, low_open=True)
        check_power_of_two(self, "block_size")
        check_field(self, "scale_quirk", validation.flag)
        check_backend(self)
        check_field(self, "total_steps", validation.integer, optional=True)
        check_field(self, "prefill_len", validation.integer, optional=True, minimum=0)

    def bind(self, *, total_steps: int, prompt_length: int, **_):
        return dataclasses.replace(self, total_steps=total_steps, prefill_len=prompt_length)

    @property
    def end_step(self) -> int:
        return int(self.total_steps * self.skip) + 1

    def _require_bound(self):
        if self.total_steps is None or self.prefill_len is None:
            raise ValueError("SparseD needs the generation's step count and prompt length: pass it as "
                             "generate(..., method=SparseD(...)), or call .bind(total_steps=, prompt_length=)")

    def init_state(self, *, batch, num_heads, num_kv_heads, q_len, kv_len, head_dim):
        self._require_bound()
        n_blocks = -(-q_len // self.block_size)
        width = pattern_width(q_len, self.prefill_len, self.block_size, self.select)
        return (jnp.zeros((batch, num_heads, n_blocks, width), jnp.int32),
                jnp.zeros((batch, num_heads, n_blocks), jnp.int32))

    def state_partition(self):
        return P("dp", "tp", "sp", None), P("dp", "tp", "sp")  # (indices, counts) per query block

    @property
    def query_block(self) -> int:
        return self.block_size

    def mode(self, step):
        self._require_bound()
        end = self.end_step
        return jnp.where(step < end, int(Mode.DENSE), jnp.where(step == end, int(Mode.ESTIMATE), int(Mode.SPARSE)))

    def pattern_mask(self, state, *, num_queries, num_keys, num_heads):
        """The keys the sparse steps attend to, bool [B, Hq, Nq, Nk] (for analysis)."""
        return pk.block_sparse.block_mask(*state, block_q=self.block_size, block_kv=self.block_size,
                                          num_queries=num_queries, num_keys=num_keys, num_heads=num_heads)

    def attend(self, q, k, v, state, mode, **masks):
        kernels.check_masks("SparseD", masks)
        b = self.block_size

        def dense(_):
            return kernels.dense(q, k, v, self.backend), state

        def estimate(_):
            if not self.scale_quirk and kernels.runs_block_mass(q, b, None, self.backend):
                # one pass gives the step's exact output and both score passes
                out, lse, mass = kernels.block_mass(q, k, v, b, None, self.backend)
                return out, select_blocks_from_mass(mass, lse, prefill_len=self.prefill_len, block_size=b,
                                                    select=self.select)
            scale = q.shape[2] ** -0.5 if self.scale_quirk else None
            pattern = select_blocks(q, k, prefill_len=self.prefill_len, block_size=b, select=self.select,
                                    scale=scale, backend=self.backend)
            return kernels.dense(q, k, v, self.backend), pattern

        def sparse(_):
            out = kernels.call(pk.block_sparse_attention, pk.block_sparse_attention_reference, self.backend,
                               q, k, v, *state, block_q=b, block_kv=b)
            return out, state

        return jax.lax.switch(mode, [dense, estimate, sparse], None)

    def attend_window(self, q, k, v, state, mode, *, start, **masks):
        """A window of queries against the cached keys: its query blocks' rows of the pattern in SPARSE
        mode, dense attention otherwise (the pattern is built by full forwards only)."""
        kernels.check_masks("SparseD", masks)
        b = self.block_size

        def sparse(_):
            return window_rows(q, start, b, state, lambda qs, rows: kernels.call(
                pk.block_sparse_attention, pk.block_sparse_attention_reference, self.backend, qs, k, v, *rows,
                block_q=b, block_kv=b))

        return jax.lax.cond(jnp.asarray(mode) == int(Mode.SPARSE), sparse,
                            lambda _: kernels.dense(q, k, v, self.backend), None)
