"""Per-step, per-layer, per-head diagnostics of a method's pattern, measured inside the compiled loop
of a bidirectional model (LLaDA, Dream: `analyze`).

`Probe(method)` is an attention policy wrapping a method: it attends exactly as the method does and,
at every call, also computes dense attention and records, per (batch row, head):
  recall   |kept ∩ oracle| / |oracle|, where oracle = for each query, its top-k keys by exact
           attention probability at this step, k = the number of keys the method keeps for that
           query (1 on dense and estimation steps, where every key is kept);
  jaccard  |top_t ∩ top_{t-1}| / |top_t ∪ top_{t-1}|, top = each query's most probable half of the
           keys: how stable the exact pattern is across consecutive steps (SparseD Fig. 6), the
           same measure whatever the method keeps; NaN at the first step;
  l1       sum |out - dense| / sum |dense|: the method's output error at this step.
At one step (`snapshot_step`: by default the first sparse step) it also keeps, per layer and head,
the exact attention probabilities and the kept fraction pooled onto a grid of at most
SNAPSHOT_GRID x SNAPSHOT_GRID cells: the per-head pattern heat maps of `plot_head_patterns`.
A method whose `pattern_mask` is None (SpargeAttn: its map is rebuilt inside each call) is measured for
jaccard and l1 only; its recall and kept fraction are NaN.
It builds [B, H, N, N] arrays per layer, so it is for analysis sizes, not long contexts.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax import validation
from dllm_jax.analysis.loops import loop_for
from dllm_jax.attention.methods import BIDIRECTIONAL
from dllm_jax.attention.dense import dense_attention
from dllm_jax.attention.policy import AttentionPolicy, Mode, check_policy


def _probabilities(q, k):
    k = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST) * q.shape[-1] ** -0.5
    return jax.nn.softmax(s, axis=-1)


def _oracle(p, counts):
    """bool [B, H, N, S]: each query's `counts` most probable keys (ties may add a few)."""
    ranked = -jnp.sort(-p, axis=-1)
    threshold = jnp.take_along_axis(ranked, jnp.maximum(counts - 1, 0)[..., None], axis=-1)
    return p >= threshold


SNAPSHOT_GRID = 64


def _pool(x, grid: int):
    """Mean of x [B, H, N, S] over cells of ceil(N / grid) x ceil(S / grid) (zero-padded edges
    count as zeros: mass stays mass, so rows of the pooled attention still sum to cell / N)."""
    b, h, n, s = x.shape
    cn, cs = -(-n // grid), -(-s // grid)
    x = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, 0), (0, -n % cn), (0, -s % cs)))
    return x.reshape(b, h, x.shape[2] // cn, cn, x.shape[3] // cs, cs).mean(axis=(3, 5))


def _jaccard(a, b):
    union = jnp.sum(a | b, axis=(2, 3))
    return jnp.sum(a & b, axis=(2, 3)) / jnp.maximum(union, 1)


@dataclasses.dataclass(frozen=True)
class Probe(AttentionPolicy):
    """Wraps a bound method and records its metrics for `steps` steps."""

    method: AttentionPolicy
    steps: int
    snapshot_step: int = 0

    def init_state(self, *, batch, num_heads, num_kv_heads, q_len, kv_len, head_dim):
        inner = self.method.init_state(batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads, q_len=q_len,
                                       kv_len=kv_len, head_dim=head_dim)
        metrics = jnp.full((3, self.steps, batch, num_heads), jnp.nan, jnp.float32)
        grid = (-(-q_len // -(-q_len // SNAPSHOT_GRID)), -(-kv_len // -(-kv_len // SNAPSHOT_GRID)))
        snapshot = jnp.zeros((2, batch, num_heads, *grid), jnp.float32)  # attention, kept fraction
        return (inner, jnp.zeros((), jnp.int32), jnp.zeros((batch, num_heads, q_len, kv_len), bool), metrics,
                snapshot)

    def stack_layers(self, states):
        inner, *rest = states
        return (self.method.stack_layers(inner), *rest)

    def mode(self, step):
        return self.method.mode(step)

    def attend(self, q, k, v, state, mode, **masks):
        inner, count, previous, metrics, snapshot = state
        out, inner = self.method.attend(q, k, v, inner, mode, **masks)
        dense = dense_attention(q, k, v, **masks)
        b, n, h, _ = q.shape
        kept = self.method.pattern_mask(inner, num_queries=n, num_keys=k.shape[1], num_heads=h)
        known = kept is not None  # a method without a fixed pattern (SpargeAttn) returns None
        sparse = jnp.asarray(mode) == int(Mode.SPARSE)
        if known:
            kept = jnp.where(sparse, kept, True)
        else:
            kept = jnp.ones((b, h, n, k.shape[1]), bool)
        p = _probabilities(q, k)
        oracle = _oracle(p, jnp.sum(kept, axis=-1))
        recall = jnp.sum(kept & oracle, axis=(2, 3)) / jnp.maximum(jnp.sum(oracle, axis=(2, 3)), 1)
        if not known:
            recall = jnp.where(sparse, jnp.nan, recall)
        # The Jaccard oracle is each query's top half of the keys, so it is comparable across steps
        # whatever the method keeps.
        top = _oracle(p, jnp.full((b, h, n), max(1, k.shape[1] // 2), jnp.int32))
        jaccard = jnp.where(count == 0, jnp.nan, _jaccard(top, previous))
        err = (jnp.abs(out.astype(jnp.float32) - dense.astype(jnp.float32)).sum(axis=(1, 3))
               / jnp.maximum(jnp.abs(dense.astype(jnp.float32)).sum(axis=(1, 3)), 1e-30))
        metrics = metrics.at[:, count].set(jnp.stack([recall, jaccard, err]))
        grid = snapshot.shape[-2]
        kept_fraction = _pool(kept, grid) if known else jnp.full(snapshot.shape[1:], jnp.nan)
        snapshot = jnp.where(count == self.snapshot_step, jnp.stack([_pool(p, grid), kept_fraction]), snapshot)
        return out, (inner, count + 1, top, metrics, snapshot)


@dataclasses.dataclass(frozen=True)
class PatternReport:
    """Metrics as float arrays [layers, steps, batch, heads]; `modes` [steps] (policy.Mode values);
    at `snapshot_step`, `attention` and `kept` [layers, batch, heads, rows, cols]: exact attention
    probability and the method's kept fraction, pooled onto a grid of at most 64 x 64 cells."""

    recall: np.ndarray
    jaccard: np.ndarray
    l1: np.ndarray
    modes: np.ndarray
    method: Any
    tokens: np.ndarray
    attention: np.ndarray
    kept: np.ndarray
    snapshot_step: int

    def summary(self) -> dict:
        sparse = self.modes == int(Mode.SPARSE)
        pick = (lambda x: x[:, sparse]) if sparse.any() else (lambda x: x)
        with warnings.catch_warnings():  # recall is all NaN for methods without a pattern mask
            warnings.simplefilter("ignore", RuntimeWarning)
            return dict(recall=float(np.nanmean(pick(self.recall))), jaccard=float(np.nanmean(self.jaccard)),
                        l1=float(np.nanmean(pick(self.l1))), sparse_steps=int(sparse.sum()))


def analyze(model, prompt_ids, method, *, seed: int = 0, snapshot_step: int | None = None,
            **options) -> PatternReport:
    """Generates with `method` on a bidirectional `model` (LLaDA or Dream) under a `Probe` and returns
    the per-step pattern metrics; the tokens are generate's for the same method, options and seed.

    `snapshot_step`: the step whose per-head patterns are kept (default: the first sparse step, else
    the last step). `options` are generate's options of the model's family (LLaDA's, or Dream's
    `DreamOptions`). Block-diffusion models (SDAR, LLaDA2): `dllm_jax.analysis.analyze_blocks`.
    """
    check_policy(method)
    seed = validation.seed(seed)
    loop = loop_for(BIDIRECTIONAL, model, prompt_ids, method, options)
    method, steps = loop.method, loop.calls
    modes = np.array([int(method.mode(jnp.int32(t))) for t in range(steps)])
    if snapshot_step is None:
        sparse_steps = np.flatnonzero(modes == int(Mode.SPARSE))
        snapshot_step = int(sparse_steps[0]) if len(sparse_steps) else steps - 1
    if not 0 <= snapshot_step < steps:
        raise ValueError(f"snapshot_step={snapshot_step} is not a step of this generation (0..{steps - 1})")
    tokens, state = loop.run(Probe(method, steps, snapshot_step), seed)
    metrics = np.asarray(state[3])  # [layers, 3, steps, B, H]
    snapshot = np.asarray(state[4])  # [layers, 2, B, H, rows, cols]
    return PatternReport(recall=metrics[:, 0], jaccard=metrics[:, 1], l1=metrics[:, 2], modes=modes, method=method,
                         tokens=np.asarray(tokens), attention=snapshot[:, 0], kept=snapshot[:, 1],
                         snapshot_step=snapshot_step)
