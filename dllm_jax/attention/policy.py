"""Attention policies: how a method plugs into every attention call of the compiled loops.

A policy is a frozen (hashable) object with static configuration and three pure functions:
  init_state(*, batch, num_heads, num_kv_heads, q_len, kv_len, head_dim) -> one layer's state,
      a pytree of fixed-shape arrays (e.g. int32 index arrays padded to a maximum, plus counts);
  mode(step) -> Mode, from the denoising step (static int or traced int32);
  attend(q, k, v, state, mode, **masks) -> (out, state), masks as `dense_attention` takes them.
The generate loop keeps a state per layer (a leading layer axis) in its carry and threads it
through the layer scan, so a method can estimate a pattern at one step and reuse it at later ones.

SDAR block steps may instead be scheduled from the block's progress: a policy that defines
  block_mode(step, *, unmasked, commit) -> Mode
gets the step within the block, the number of block tokens unmasked since its last step that was
not SPARSE (FlashBlock's "dirty" count), and whether this forward commits the block to the cache.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from dllm_jax.attention.dense import dense_attention


class Mode(enum.IntEnum):
    DENSE = 0  # exact attention, the policy's state untouched
    ESTIMATE = 1  # exact attention that (re)builds the pattern
    SPARSE = 2  # the cheap step: reuses the pattern or cached partial results
    REFRESH = 3  # exact attention that refreshes cached partial results, keeping the pattern


class AttentionPolicy(Protocol):
    def init_state(self, *, batch: int, num_heads: int, num_kv_heads: int, q_len: int, kv_len: int,
                   head_dim: int) -> Any: ...

    def mode(self, step) -> Any: ...

    def attend(self, q, k, v, state, mode, **masks) -> tuple[Any, Any]: ...


@dataclasses.dataclass(frozen=True)
class Dense:
    """The default policy: dense attention, no state."""

    def init_state(self, **shapes):
        return ()

    def mode(self, step):
        return Mode.DENSE

    def attend(self, q, k, v, state, mode, **masks):
        return dense_attention(q, k, v, **masks), state


def block_mode(policy, step, *, unmasked, commit):
    """The mode of an SDAR block step (see the module docstring); policies without `block_mode`
    choose from the step within the block alone."""
    schedule = getattr(policy, "block_mode", None)
    if schedule is None:
        return policy.mode(step)
    return schedule(step, unmasked=unmasked, commit=commit)


def unmasked_since_refresh(unmasked, mode, newly_unmasked):
    """The count `block_mode` gets at the next forward: reset by any forward that was not SPARSE,
    then this forward's newly unmasked tokens added."""
    return jnp.where(jnp.asarray(mode) == int(Mode.SPARSE), unmasked, 0) + newly_unmasked


def stacked_state(policy, num_layers: int, **shapes):
    """`policy.init_state(**shapes)` for every layer, stacked on a leading layer axis; a policy
    whose layers differ (e.g. MAGE's exact first layers) adjusts the stack in `stack_layers`."""
    one = policy.init_state(**shapes)
    stacked = jax.tree.map(lambda s: jnp.broadcast_to(s, (num_layers, *jnp.shape(s))), one)
    adjust = getattr(policy, "stack_layers", None)
    return stacked if adjust is None else adjust(stacked)


def attend_layer(policy, mode, q, k, v, states, layer, **masks):
    """`policy.attend` on layer `layer`'s slice of the stacked states; returns (out, states)."""
    state = jax.tree.map(lambda s: s[layer], states)
    out, state = policy.attend(q, k, v, state, mode, **masks)
    return out, jax.tree.map(lambda s, new: s.at[layer].set(new), states, state)


def check_policy(policy) -> None:
    missing = [name for name in ("init_state", "mode", "attend") if not callable(getattr(policy, name, None))]
    if missing:
        raise ValueError(f"method={policy!r} is not an attention policy: it lacks {missing} "
                         "(see dllm_jax.attention.policy)")
    try:
        hash(policy)
    except TypeError as e:
        raise ValueError(f"method={policy!r} must be hashable (a frozen dataclass): it is a static argument") from e
