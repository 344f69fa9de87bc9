"""Per-step, per-layer, per-head diagnostics of a method's pattern, measured inside the compiled loop.

`Probe(method)` is an attention policy wrapping a method: it attends exactly as the method does and,
at every call, also computes dense attention and records, per (batch row, head):
  recall   |kept ∩ oracle| / |oracle|, where oracle = for each query, its top-k keys by exact
           attention probability at this step, k = the number of keys the method keeps for that
           query (1 on dense and estimation steps, where every key is kept);
  jaccard  |oracle_t ∩ oracle_{t-1}| / |oracle_t ∪ oracle_{t-1}|: how stable the exact pattern is
           across consecutive steps (SparseD Fig. 6); NaN at the first step;
  l1       sum |out - dense| / sum |dense|: the method's output error at this step.
It builds [B, H, N, N] arrays per layer, so it is for analysis sizes, not long contexts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.attention.dense import dense_attention
from dllm_jax.attention.policy import Mode


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


def _jaccard(a, b):
    union = jnp.sum(a | b, axis=(2, 3))
    return jnp.sum(a & b, axis=(2, 3)) / jnp.maximum(union, 1)


@dataclasses.dataclass(frozen=True)
class Probe:
    """Wraps a bound method (one with `pattern_mask`) and records its metrics for `steps` steps."""

    method: Any
    steps: int

    def init_state(self, *, batch, num_heads, num_kv_heads, q_len, kv_len, head_dim):
        inner = self.method.init_state(batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads, q_len=q_len,
                                       kv_len=kv_len, head_dim=head_dim)
        metrics = jnp.full((3, self.steps, batch, num_heads), jnp.nan, jnp.float32)
        return inner, jnp.zeros((), jnp.int32), jnp.zeros((batch, num_heads, q_len, kv_len), bool), metrics

    def mode(self, step):
        return self.method.mode(step)

    def attend(self, q, k, v, state, mode, **masks):
        inner, count, previous, metrics = state
        out, inner = self.method.attend(q, k, v, inner, mode, **masks)
        dense = dense_attention(q, k, v, **masks)
        b, n, h, _ = q.shape
        kept = self.method.pattern_mask(inner, num_queries=n, num_keys=k.shape[1], num_heads=h)
        kept = jnp.where(jnp.asarray(mode) == int(Mode.SPARSE), kept, True)
        p = _probabilities(q, k)
        oracle = _oracle(p, jnp.sum(kept, axis=-1))
        recall = jnp.sum(kept & oracle, axis=(2, 3)) / jnp.maximum(jnp.sum(oracle, axis=(2, 3)), 1)
        jaccard = jnp.where(count == 0, jnp.nan, _jaccard(oracle, previous))
        err = (jnp.abs(out.astype(jnp.float32) - dense.astype(jnp.float32)).sum(axis=(1, 3))
               / jnp.maximum(jnp.abs(dense.astype(jnp.float32)).sum(axis=(1, 3)), 1e-30))
        metrics = metrics.at[:, count].set(jnp.stack([recall, jaccard, err]))
        return out, (inner, count + 1, oracle, metrics)


@dataclasses.dataclass(frozen=True)
class PatternReport:
    """Metrics as float arrays [layers, steps, batch, heads]; `modes` [steps] (policy.Mode values)."""

    recall: np.ndarray
    jaccard: np.ndarray
    l1: np.ndarray
    modes: np.ndarray
    method: Any
    tokens: np.ndarray

    def summary(self) -> dict:
        sparse = self.modes == int(Mode.SPARSE)
        pick = (lambda x: x[:, sparse]) if sparse.any() else (lambda x: x)
        return dict(recall=float(np.nanmean(pick(self.recall))), jaccard=float(np.nanmean(self.jaccard)),
                    l1=float(np.nanmean(pick(self.l1))), sparse_steps=int(sparse.sum()))


def analyze(model, prompt_ids, method, *, seed: int = 0, **options) -> PatternReport:
    """Generates with `method` on a LLaDA `model` and returns the per-step pattern metrics."""
    from dllm_jax.generate import make_options
    from dllm_jax.generate.llada import LLaDAOptions, check_prompt, generate_llada_jit

    opts = make_options(LLaDAOptions, "LLaDA", options)
    prompt_ids = np.asarray(prompt_ids, np.int32)
    check_prompt(model.config, prompt_ids, None)
    if hasattr(method, "bind"):
        method = method.bind(total_steps=opts.steps, prompt_length=prompt_ids.shape[1], gen_length=opts.gen_length)
    if not callable(getattr(method, "pattern_mask", None)):
        raise ValueError(f"{type(method).__name__} has no pattern_mask(state, ...): it cannot be analysed")
    tokens, state = generate_llada_jit(model.params(), prompt_ids, None, np.int32(seed), np.int32(0),
                                       config=model.config, options=opts,
                                       prompt_has_masks=bool((prompt_ids == model.config.mask_token_id).any()),
                                       policy=Probe(method, opts.steps), return_policy_state=True)
    metrics = np.asarray(state[3])  # [layers, 3, steps, B, H]
    modes = np.array([int(method.mode(jnp.int32(t))) for t in range(opts.steps)])
    return PatternReport(recall=metrics[:, 0], jaccard=metrics[:, 1], l1=metrics[:, 2], modes=modes, method=method,
                         tokens=np.asarray(tokens))
