"""Attention policies: the one way every model call attends (`Dense()` by default).

A policy is a frozen dataclass deriving from `AttentionPolicy` (hashable: it is a static argument of
the jitted functions), with static configuration and pure functions:
  init_state(*, batch, num_heads, num_kv_heads, q_len, kv_len, head_dim) -> one layer's state,
      a pytree of fixed-shape arrays (e.g. int32 index arrays padded to a maximum, plus counts);
  mode(step) -> Mode, from the denoising step (static int or traced int32);
  attend(q, k, v, state, mode, **masks) -> (out, state), masks as `dense_attention` takes them.
The generate loop keeps a state per layer (a leading layer axis) in its carry and threads it
through the layer scan, so a method can estimate a pattern at one step and reuse it at later ones.

`mode` and `attend` are required; every other hook has a default in `AttentionPolicy`, so the
models, loops and diagnostics call them unconditionally:
  init_state(...)            -> () (no state);
  bind(*, total_steps, prompt_length, gen_length) -> the policy fixed to one LLaDA generation's
                                schedule (SparseD, PulseCol, SpargeAttn); default: itself;
  stack_layers(states)       -> the stacked per-layer states adjusted where layers differ (MAGE's
                                exact first layers, per-layer SpargeAttn values); default: unchanged;
  block_mode(step, *, unmasked, commit) -> the mode of an SDAR block step, from the step within the
                                block, the block tokens unmasked since the last forward that was not
                                SPARSE (FlashBlock's "dirty" count) and whether this forward commits
                                the block to the cache; default: mode(step);
  reads_stacked_cache        -> True: SDAR block steps pass the whole stacked cache [L, B, S, Hkv, D]
                                and `cache_layer` (the kernels read the layer in place); default False;
  pattern_mask(state, *, num_queries, num_keys, num_heads) -> the keys the sparse steps attend to,
                                bool [B, Hq, Nq, Nk], or None where no fixed pattern exists (default);
  selection(state)           -> (indices [B, Hkv, k], exact) of a prefix selection (MAGE), or None.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from dllm_jax.attention.dense import dense_attention


class Mode(enum.IntEnum):
    DENSE = 0  # exact attention, the policy's state untouched
    ESTIMATE = 1  # exact attention that (re)builds the pattern
    SPARSE = 2  # the cheap step: reuses the pattern or cached partial results
    REFRESH = 3  # exact attention that refreshes cached partial results, keeping the pattern


@dataclasses.dataclass(frozen=True)
class AttentionPolicy(abc.ABC):
    """Base of every attention policy: the required `mode` and `attend`, a default for each optional
    hook (see the module docstring). Subclasses are frozen dataclasses (static, hashable)."""

    reads_stacked_cache: ClassVar[bool] = False

    def init_state(self, *, batch: int, num_heads: int, num_kv_heads: int, q_len: int, kv_len: int,
                   head_dim: int) -> Any:
        return ()

    @abc.abstractmethod
    def mode(self, step) -> Any:
        """The Mode of a LLaDA step (static int or traced int32)."""

    @abc.abstractmethod
    def attend(self, q, k, v, state, mode, **masks) -> tuple[Any, Any]:
        """(out [B, Nq, Hq, D], new state) of one layer."""

    def bind(self, *, total_steps: int | None = None, prompt_length: int | None = None,
             gen_length: int | None = None) -> "AttentionPolicy":
        return self

    def stack_layers(self, states):
        return states

    def block_mode(self, step, *, unmasked, commit):
        return self.mode(step)

    def pattern_mask(self, state, *, num_queries: int, num_keys: int, num_heads: int):
        return None

    def selection(self, state):
        return None


@dataclasses.dataclass(frozen=True)
class Dense(AttentionPolicy):
    """The default policy: `dense_attention` (cuDNN flash attention on GPU for bf16, XLA otherwise), no state."""

    def mode(self, step):
        return Mode.DENSE

    def attend(self, q, k, v, state, mode, **masks):
        return dense_attention(q, k, v, **masks), state


def unmasked_since_refresh(unmasked, mode, newly_unmasked):
    """The count `block_mode` gets at the next forward: reset by any forward that was not SPARSE,
    then this forward's newly unmasked tokens added."""
    return jnp.where(jnp.asarray(mode) == int(Mode.SPARSE), unmasked, 0) + newly_unmasked


def stacked_state(policy: AttentionPolicy, num_layers: int, **shapes):
    """`policy.init_state(**shapes)` for every layer, stacked on a leading layer axis, then adjusted
    by `policy.stack_layers` where layers differ (e.g. MAGE's exact first layers)."""
    one = policy.init_state(**shapes)
    return policy.stack_layers(jax.tree.map(lambda s: jnp.broadcast_to(s, (num_layers, *jnp.shape(s))), one))


def attend_layer(policy: AttentionPolicy, mode, q, k, v, states, layer, **masks):
    """`policy.attend` on layer `layer`'s slice of the stacked states; returns (out, states)."""
    state = jax.tree.map(lambda s: s[layer], states)
    out, state = policy.attend(q, k, v, state, mode, **masks)
    return out, jax.tree.map(lambda s, new: s.at[layer].set(new), states, state)


def check_policy(policy) -> None:
    """Raises ValueError unless `policy` is a hashable AttentionPolicy (a static argument of the loops)."""
    if not isinstance(policy, AttentionPolicy):
        raise ValueError(f"method={policy!r} is not an attention policy: pass a method name, None (dense), or "
                         "an instance of a dllm_jax.attention.policy.AttentionPolicy subclass (Dense(), "
                         "SparseD(...), MAGE(...), ...)")
    try:
        hash(policy)
    except TypeError as e:
        raise ValueError(f"method={policy!r} must be hashable (a frozen dataclass): it is a static argument") from e
