"""Diagnostics of block-diffusion methods (MAGE, FlashBlock, their combination) on SDAR and LLaDA2 (both
decode block by block over a prefix KV cache), per forward, layer and head, measured inside the compiled
generate loop.

`BlockProbe(method, calls)` wraps a method and, at every block-step forward, records
  recall  per KV head: |S_1 ∩ S_t| / |S_1|, with S_1 the prefix set the method selected at the
          block's first step and S_t the oracle of this step: the top-|S_1| prefix positions by
          MAGE's Eq. 3 score of this step's queries (the MAGE paper's Fig. 2 measurement); NaN for
          methods that select nothing, on exact layers and where the prefix is empty;
  l1      per query head: sum |out - exact| / sum |exact| over the block's queries and head_dim
          (the FlashBlock paper's Table 3 measurement), exact = attention over every key.
With `trajectory="dense"` (the default) the probe feeds the exact output to the model, so every
method is measured on the same inputs: the dense generation's queries, keys and unmasking steps.
With "method" the generation follows the method's own outputs. Exact attention is computed densely
(jnp), so this is for analysis sizes.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax.numpy as jnp
import numpy as np

import pallas_kernels as pk
from dllm_jax import validation
from dllm_jax.analysis.loops import loop_for
from dllm_jax.attention.methods import BLOCK
from dllm_jax.attention.mage import prefix_counts, row_lengths, select_prefix
from dllm_jax.attention.policy import AttentionPolicy, Mode, check_policy

TRAJECTORIES = ("dense", "method")


def _recall(selected, oracle, count):
    """|selected ∩ oracle| / count per (B, Hkv) for sorted-or-not lists whose first `count` ([B, 1])
    are live."""
    live = jnp.arange(selected.shape[-1]) < count[..., None]  # [B, 1, k]
    hit = jnp.any((selected[..., :, None] == oracle[..., None, :]) & live[..., None, :], axis=-1)
    return jnp.sum(hit & live, axis=-1) / jnp.maximum(count, 1)


@dataclasses.dataclass(frozen=True)
class BlockProbe(AttentionPolicy):
    """Wraps a block-diffusion method and records its metrics for up to `calls` block-step forwards."""

    method: AttentionPolicy
    calls: int
    trajectory: str = "dense"

    def init_state(self, *, batch, num_heads, num_kv_heads, q_len, kv_len, head_dim):
        inner = self.method.init_state(batch=batch, num_heads=num_heads, num_kv_heads=num_kv_heads, q_len=q_len,
                                       kv_len=kv_len, head_dim=head_dim)
        recall = jnp.full((self.calls, batch, num_kv_heads), jnp.nan, jnp.float32)
        l1 = jnp.full((self.calls, batch, num_heads), jnp.nan, jnp.float32)
        log = jnp.full((2, self.calls), -1, jnp.int32)  # mode and prefix length of every call
        return inner, jnp.zeros((), jnp.int32), recall, l1, log

    def stack_layers(self, states):
        inner, *rest = states
        return (self.method.stack_layers(inner), *rest)

    def mode(self, step):
        return self.method.mode(step)

    def block_mode(self, step, *, unmasked, commit):
        return self.method.block_mode(step, unmasked=unmasked, commit=commit)

    def attend(self, q, k, v, state, mode, *, kv_len, **masks):
        inner, call, recall, l1, log = state
        out, inner = self.method.attend(q, k, v, inner, mode, kv_len=kv_len, **masks)
        exact = pk.split_kv_attention_reference(q, k, v, kv_len=kv_len)
        err = (jnp.abs(out.astype(jnp.float32) - exact).sum(axis=(1, 3))
               / jnp.maximum(jnp.abs(exact).sum(axis=(1, 3)), 1e-30))
        l1 = l1.at[call].set(err)
        prefix = row_lengths(kv_len, q.shape[0]) - q.shape[1]
        selection = self.method.selection(inner)
        if selection is not None:
            indices, exact_layer = selection
            count = prefix_counts(prefix, indices.shape[-1])[:, None]  # [B, 1]: per row
            oracle = select_prefix(q, k, prefix_len=prefix, k=indices.shape[-1], backend="reference")
            r = jnp.where(exact_layer | (count == 0), jnp.nan, _recall(indices, oracle, count))
            recall = recall.at[call].set(r)
        # the report covers one prompt: row 0's mode and prefix
        log = log.at[:, call].set(jnp.stack([jnp.broadcast_to(jnp.asarray(mode, jnp.int32), prefix.shape)[0],
                                             prefix[0]]))
        if self.trajectory == "dense":
            out = exact.astype(out.dtype)
        return out, (inner, call + 1, recall, l1, log)


@dataclasses.dataclass(frozen=True)
class BlockReport:
    """recall [layers, calls, B, Hkv], l1 [layers, calls, B, Hq] as float arrays (NaN where not
    measured); per call: `modes` (policy.Mode), `prefix` (cache length = the block's start) and
    `step` (the forward's index within its block; the commit forward is the last of each block)."""

    recall: np.ndarray
    l1: np.ndarray
    modes: np.ndarray
    prefix: np.ndarray
    step: np.ndarray
    method: Any
    tokens: np.ndarray

    def commit(self) -> np.ndarray:
        """bool [calls]: the commit of each block (its last call; the last block's commit is not run:
        the loop commits a block in the next block's first forward)."""
        return np.append(self.step[1:] == 0, False)

    def later(self) -> np.ndarray:
        """bool [calls]: denoising forwards after a block's first step (the commit forward excluded)."""
        return (self.step > 0) & ~self.commit()

    def summary(self) -> dict:
        later = self.later()
        with warnings.catch_warnings():  # all-NaN slices are expected (exact layers, empty prefixes)
            warnings.simplefilter("ignore", RuntimeWarning)
            recall = float(np.nanmean(self.recall[:, later])) if later.any() else float("nan")
            l1 = float(np.nanmean(self.l1[:, later])) if later.any() else float("nan")
        return dict(recall=recall, l1=l1, later_steps=int(later.sum()),
                    sparse_steps=int((self.modes == int(Mode.SPARSE)).sum()),
                    refresh_steps=int((self.modes == int(Mode.REFRESH)).sum()))


def analyze_blocks(model, prompt_ids, method, *, seed: int = 0, trajectory: str = "dense", **options) -> BlockReport:
    """Generates with `method` on a block-diffusion `model` (SDAR, or LLaDA2: the same prefix-cache loop)
    under a `BlockProbe`; returns the metrics. `options` are generate's options of the model's family
    (SDAR's, or LLaDA2's `LLaDA2Options`). The tokens are the loop's raw [B, width] output (generate trims
    them at the stop token): on the "dense" trajectory those of dense generation, on "method" the method's.
    Bidirectional models (LLaDA, Dream): `dllm_jax.analysis.analyze`."""
    if trajectory not in TRAJECTORIES:
        raise ValueError(f"trajectory must be one of {TRAJECTORIES}, got {trajectory!r}")
    check_policy(method)
    seed = validation.seed(seed)
    loop = loop_for(BLOCK, model, prompt_ids, method, options)
    tokens, state = loop.run(BlockProbe(loop.method, loop.calls, trajectory), seed)
    recall, l1, log = (np.asarray(x) for x in state[2:])
    used = log[0, 1] >= 0  # every layer logs the same calls
    # the first forward's commit part has no block to commit (its output is discarded): not a call
    used &= np.arange(used.size) > 0
    modes, prefix = log[0, 0, used], log[0, 1, used]
    step = np.zeros_like(prefix)
    for i in range(1, len(prefix)):
        step[i] = 0 if prefix[i] != prefix[i - 1] else step[i - 1] + 1
    return BlockReport(recall=recall[:, used], l1=l1[:, used], modes=modes, prefix=prefix, step=step, method=method,
                       tokens=np.asarray(tokens))
