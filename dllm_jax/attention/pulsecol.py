"""PulseCol (arXiv 2605.20813) as an attention policy for LLaDA, following the paper (no public code;
docs/methods.md §2 and papers/pulsecol.md).

Queries are split into contiguous groups of `group_size`. At each refresh step the layer attends
densely (its output is exact) and scores every key for every group by the mean softmax probability
over the group's queries; each group keeps its top k = (1 - sparsity) * N keys. Every other step
attends only to those keys through `column_sparse_attention`; after the refresh window the last
pattern is kept.

Refresh steps (1-based), `refresh_steps(T, eta, R)`: T_win = floor(eta * T);
  R == 1: (1,);  R >= 2: tau_r = 1 + floor((r - 1) * (T_win - 1) / (R - 1)), r = 1..R.
So step 1 is always a refresh and sparse attention starts at step 2.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import pallas_kernels as pk
from dllm_jax import validation
from dllm_jax.attention import kernels
from dllm_jax.attention.policy import (AttentionPolicy, Mode, check_backend, check_field, check_power_of_two,
                                       window_rows)


def refresh_steps(total_steps: int, eta: float, refreshes: int) -> tuple[int, ...]:
    """The paper's uniform refresh schedule: sorted distinct 1-based steps within the window.

    A window shorter than one step is taken as one step (step 1 is always a refresh); steps that
    coincide in a short window appear once.
    """
    if total_steps < 1 or refreshes < 1:
        raise ValueError(f"total_steps={total_steps} and refreshes={refreshes} must be >= 1")
    if refreshes == 1:
        return (1,)
    window = max(1, math.floor(eta * total_steps))
    if refreshes >= window:  # the steps (window - 1) / (refreshes - 1) <= 1 apart hit every step: no loop over R
        return tuple(range(1, window + 1))
    return tuple(sorted({1 + (r - 1) * (window - 1) // (refreshes - 1) for r in range(1, refreshes + 1)}))


def num_keep(length: int, sparsity: float) -> int:
    """k = (1 - sparsity) * N keys per group, at least one and at most N."""
    return min(length, max(1, round((1.0 - sparsity) * length)))


def select_columns(q, k, *, group_size: int, num_keep: int, scale=None, backend: str = "auto"):
    """PulseCol's pattern for q [B, N, Hq, D] against k [B, N, Hkv, D].

    Returns (col_indices int32 [B, Hq, ceil(N / group_size), num_keep] ascending, col_counts int32
    [B, Hq, ceil(N / group_size)] = num_keep), the format of `column_sparse_attention`.
    """
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    scores = kernels.column_scores(q, k, group_size, scale, backend)  # [B, H, nG, N]
    _, idx = jax.lax.top_k(scores, num_keep)
    idx = jnp.sort(idx.astype(jnp.int32), axis=-1)
    return idx, jnp.full(idx.shape[:-1], num_keep, jnp.int32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PulseCol(AttentionPolicy):
    """PulseCol's configuration; `bind` (called by `generate`) fixes the refresh schedule.

    sparsity: fraction of keys dropped per query group (0.8; 0 keeps all).
    group_size: queries sharing one column set (32, the paper's best; a power of two >= 16).
    eta: refresh-window ratio (0.3). refreshes: refresh budget R (16 for LLaDA-1.5).
    backend: as SparseD's ("auto": Pallas on GPU, references elsewhere).
    """

    sparsity: float = 0.8
    group_size: int = 32
    eta: float = 0.3
    refreshes: int = 16
    backend: str = "auto"
    total_steps: int | None = None

    def __post_init__(self):
        check_field(self, "sparsity", validation.real, low=0, high=1, high_open=True)
        check_power_of_two(self, "group_size")
        check_field(self, "eta", validation.real, low=0, high=1, low_open=True)
        check_field(self, "refreshes", validation.integer)
        check_backend(self)
        check_field(self, "total_steps", validation.integer, optional=True)

    def bind(self, *, total_steps: int, **_):
        return dataclasses.replace(self, total_steps=total_steps)

    @property
    def schedule(self) -> tuple[int, ...]:
        if self.total_steps is None:
            raise ValueError("PulseCol needs the generation's step count: pass it as generate(..., "
                             "method=PulseCol(...)), or call .bind(total_steps=)")
        return refresh_steps(self.total_steps, self.eta, self.refreshes)

    def init_state(self, *, batch, num_heads, num_kv_heads, q_len, kv_len, head_dim):
        # The pattern is (1 - sparsity) * N indices per group, head and layer (27 GB in int32 for
        # LLaDA-8B at 64k with groups of 128); uint16 halves it whenever positions fit.
        index_dtype = jnp.uint16 if kv_len <= 1 << 16 else jnp.int32
        groups = -(-q_len // self.group_size)
        keep = num_keep(kv_len, self.sparsity)
        return (jnp.zeros((batch, num_heads, groups, keep), index_dtype),
                jnp.zeros((batch, num_heads, groups), jnp.int32))

    def state_partition(self):
        return P("dp", "tp", "sp", None), P("dp", "tp", "sp")  # (columns, counts) per query group

    @property
    def query_block(self) -> int:
        return self.group_size

    def mode(self, step):
        refresh = jnp.isin(step + 1, jnp.asarray(np.array(self.schedule, np.int32)))  # steps are 1-based
        return jnp.where(refresh, int(Mode.ESTIMATE), int(Mode.SPARSE))

    def pattern_mask(self, state, *, num_queries, num_keys, num_heads):
        """The keys the sparse steps attend to, bool [B, Hq, Nq, Nk] (for analysis)."""
        return pk.column_sparse.column_mask(*state, group_size=self.group_size, num_queries=num_queries,
                                            num_keys=num_keys, num_heads=num_heads)

    def attend(self, q, k, v, state, mode, **masks):
        kernels.check_masks("PulseCol", masks)

        def estimate(_):
            idx, counts = select_columns(q, k, group_size=self.group_size, num_keep=state[0].shape[-1],
                                         backend=self.backend)
            return kernels.dense(q, k, v, self.backend), (idx.astype(state[0].dtype), counts)

        def sparse(_):
            out = kernels.call(pk.column_sparse_attention, pk.column_sparse_attention_reference, self.backend,
                               q, k, v, *state, group_size=self.group_size)
            return out, state

        return jax.lax.switch(jnp.asarray(mode) - int(Mode.ESTIMATE), [estimate, sparse], None)

    def attend_window(self, q, k, v, state, mode, *, start, **masks):
        """A window of queries against the cached keys: its query groups' columns in SPARSE mode,
        dense attention otherwise (the pattern is built by full forwards only)."""
        kernels.check_masks("PulseCol", masks)

        def sparse(_):
            return window_rows(q, start, self.group_size, state, lambda qs, rows: kernels.call(
                pk.column_sparse_attention, pk.column_sparse_attention_reference, self.backend, qs, k, v, *rows,
                group_size=self.group_size))

        return jax.lax.cond(jnp.asarray(mode) == int(Mode.SPARSE), sparse,
                            lambda _: kernels.dense(q, k, v, self.backend), None)
