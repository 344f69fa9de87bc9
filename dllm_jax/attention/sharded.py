"""Attention on a mesh: any policy run per device with `jax.shard_map` (`dllm_jax.sharding`).

XLA's partitioner cannot split a Pallas kernel (nor cuDNN attention along the sequence), so the
attention of a model placed on a mesh runs inside a `shard_map`: each device attends its own batch
rows ("dp"), its own heads ("tp": Megatron's split keeps every KV-head group on one device) and,
for LLaDA's full-sequence forwards, its own slice of the queries ("sp"), after an all-gather of the
keys and values of the whole sequence over "sp". The policy's state is split the same way
(`AttentionPolicy.state_partition`), so a sparse method's kernels run on each device's rows of its
pattern. Everything else in the model is left to XLA's partitioner.

All-gather rather than ring passing: at LLaDA-8B's shapes a layer's keys and values at 64k are
32 MiB against about 150 ms of attention, so there is no transfer worth hiding behind compute.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from dllm_jax.attention.policy import AttentionPolicy

QUERIES = P("dp", "sp", "tp", None)  # [B, L, H, D]: rows, query positions, heads
WHOLE = P("dp", None, "tp", None)  # [B, S, H, D] every position on every "sp" device (a cache, a window)


def without_sp(spec):
    """`spec` with its "sp" axis replicated (a window's queries read any rows of the pattern)."""
    return P(*(None if axis == "sp" else axis for axis in spec))


def is_spec(x) -> bool:
    return isinstance(x, P)


@dataclasses.dataclass(frozen=True)
class Sharded(AttentionPolicy):
    """`inner` on every device of `mesh` (axes "dp", "sp", "tp"), each on its shard of the inputs.

    `generate` wraps a model's policy in it when the model was loaded with `mesh=`; every hook but
    the two attention calls is the inner policy's.
    """

    inner: AttentionPolicy
    mesh: Mesh

    def __post_init__(self):
        if not isinstance(self.inner, AttentionPolicy):
            raise ValueError(f"Sharded.inner must be an attention policy, got {self.inner!r} "
                             f"({type(self.inner).__name__})")
        if not isinstance(self.mesh, Mesh):
            raise ValueError(f"Sharded.mesh must be a jax.sharding.Mesh, got {self.mesh!r} ({type(self.mesh).__name__})")

    def init_state(self, **shapes):
        return self.inner.init_state(**shapes)

    def mode(self, step):
        return self.inner.mode(step)

    def bind(self, **schedule):
        return dataclasses.replace(self, inner=self.inner.bind(**schedule))

    def stack_layers(self, states):
        return self.inner.stack_layers(states)

    def block_mode(self, step, *, unmasked, commit):
        return self.inner.block_mode(step, unmasked=unmasked, commit=commit)

    def at_layer(self, layer: int):
        return dataclasses.replace(self, inner=self.inner.at_layer(layer))

    def later_steps_sparse(self) -> bool:
        return self.inner.later_steps_sparse()

    def first_steps_estimate(self) -> bool:
        return self.inner.first_steps_estimate()

    def commits_sparse(self) -> bool:
        return self.inner.commits_sparse()

    def pattern_mask(self, state, **shape):
        return self.inner.pattern_mask(state, **shape)

    def selection(self, state):
        return self.inner.selection(state)

    def state_partition(self):
        return self.inner.state_partition()

    @property
    def query_block(self) -> int:
        return self.inner.query_block

    def _state_specs(self, state, *, window: bool):
        specs = self.inner.state_partition()
        if jax.tree.structure(specs, is_leaf=is_spec) != jax.tree.structure(state):
            raise ValueError(f"{type(self.inner).__name__}.state_partition() does not match the structure of its "
                             "state: it cannot run on a mesh")
        return jax.tree.map(without_sp, specs, is_leaf=is_spec) if window else specs

    def attend(self, q, k, v, state, mode, **masks):
        sp = self.mesh.shape["sp"]
        full = masks.get("kv_len") is None and k.shape[1] == q.shape[1]
        if sp > 1 and not full:
            raise ValueError("sequence parallelism (sp > 1) splits the queries of a full-sequence forward (LLaDA); "
                             "block steps against a KV cache take tp and dp only")
        kv_spec = QUERIES if full else WHOLE
        state_specs = self._state_specs(state, window=False)

        static_mode = mode if isinstance(mode, int) else None  # stays a Python int inside (see `switch_rows`)

        def local(q, k, v, state, mode, arrays):
            if full and sp > 1:
                k = jax.lax.all_gather(k, "sp", axis=1, tiled=True)
                v = jax.lax.all_gather(v, "sp", axis=1, tiled=True)
            return self.inner.attend(q, k, v, state, mode if static_mode is None else static_mode, **arrays, **static)

        arrays, static = split_masks(masks)
        mode = jnp.asarray(mode)
        run = jax.shard_map(local, mesh=self.mesh, check_vma=False,
                            in_specs=(QUERIES, kv_spec, kv_spec, state_specs, rows_spec(mode),
                                      mask_specs(arrays, queries="sp")),
                            out_specs=(QUERIES, state_specs))
        return run(q, k, v, state, mode, arrays)

    def attend_window(self, q, k, v, state, mode, *, start, **masks):
        # a window (Fast-dLLM's cached steps) is a few queries: every "sp" device attends all of them
        state_specs = self._state_specs(state, window=True)

        def local(q, k, v, state, mode, start, arrays):
            return self.inner.attend_window(q, k, v, state, mode, start=start, **arrays, **static)

        arrays, static = split_masks(masks)
        mode = jnp.asarray(mode)
        run = jax.shard_map(local, mesh=self.mesh, check_vma=False,
                            in_specs=(WHOLE, WHOLE, WHOLE, state_specs, rows_spec(mode), P(),
                                      mask_specs(arrays, queries=None)),
                            out_specs=WHOLE)
        return run(q, k, v, state, mode, jnp.asarray(start), arrays)


def split_masks(masks: dict) -> tuple[dict, dict]:
    """(array-valued masks, the rest: None or a Python scale) of an attention call's keyword arguments."""
    arrays = {name: jnp.asarray(value) for name, value in masks.items()
              if value is not None and name != "scale"}
    return arrays, {name: value for name, value in masks.items() if name not in arrays}


def rows_spec(x) -> P:
    """A scalar is replicated; a per-row value [B] follows the rows."""
    return P() if jnp.ndim(x) == 0 else P("dp")


def mask_specs(arrays: dict, *, queries: Any) -> dict:
    """How each mask of `dense_attention`'s contract splits: key_mask [B, S] by rows; mask [L, S] or
    [B, L, S] by query positions (over `queries`) and rows; kv_len scalar or [B]."""
    specs = {}
    for name, value in arrays.items():
        if name == "key_mask":
            specs[name] = P("dp", None)
        elif name == "mask":
            specs[name] = P(queries, None) if value.ndim == 2 else P("dp", queries, None)
        elif name == "kv_len":
            specs[name] = rows_spec(value)
        else:
            raise ValueError(f"attention on a mesh does not know how to split the mask {name!r}")
    return specs
