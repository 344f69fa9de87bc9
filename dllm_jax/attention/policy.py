"""Attention policies: the one way every model call attends (`Dense()` by default).

A policy is a frozen dataclass deriving from `AttentionPolicy` (hashable: it is a static argument of
the jitted functions), with static configuration and pure functions:
  init_state(*, batch, num_heads, num_kv_heads, q_len, kv_len, head_dim) -> one layer's state,
      a pytree of fixed-shape arrays (e.g. int32 index arrays padded to a maximum, plus counts),
      batch axis first where a leaf has one;
  mode(step) -> Mode, from the denoising step (static int or traced int32);
  attend(q, k, v, state, mode, **masks) -> (out, state), masks as `dense_attention` takes them;
      k, v are always one layer's keys and values [B, S, Hkv, D]. In SDAR block steps, `kv_len` is
      int32 [B] (each row's filled length + n: batched rows sit at different positions) and `mode`
      an int32 scalar or [B] (per-row modes; see `switch_rows`).
The generate loop keeps a state per layer in its carry and threads it through the layers, so a
method can estimate a pattern at one step and reuse it at later ones.

`mode` and `attend` are required; every other hook has a default in `AttentionPolicy`, so the
models, loops and diagnostics call them unconditionally:
  init_state(...)            -> () (no state);
  bind(*, total_steps, prompt_length, gen_length) -> the policy fixed to one LLaDA generation's
                                schedule (SparseD, PulseCol, SpargeAttn); default: itself;
  stack_layers(states)       -> the stacked per-layer states adjusted where layers differ (MAGE's
                                exact first layers, per-layer SpargeAttn values); default: unchanged;
  block_mode(step, *, unmasked, commit) -> the mode of an SDAR block step (int32 scalar or [B]), from
                                the step within the block (int32 scalar or [B]), the block tokens
                                unmasked since the last forward that was not SPARSE (FlashBlock's
                                "dirty" count, int32 [B]) and whether this forward commits the block
                                to the cache (bool scalar); default: mode(step);
  pattern_mask(state, *, num_queries, num_keys, num_heads) -> the keys the sparse steps attend to,
                                bool [B, Hq, Nq, Nk], or None where no fixed pattern exists (default);
  selection(state)           -> (indices [B, Hkv, k], exact) of a prefix selection (MAGE), or None;
  attend_window(q, k, v, state, mode, *, start, **masks) -> out [B, W, Hq, D] of a window of W
                                queries at positions start .. start + W - 1 (traced start) against
                                the whole sequence's keys (LLaDA's Fast-dLLM cached steps; the
                                state is only read); default: ValueError (Dense, SparseD and
                                PulseCol implement it);
  state_partition()          -> how one layer's state splits over a mesh (`dllm_jax.sharding`): a
                                pytree of `PartitionSpec`s shaped like the state, naming "dp" for
                                its batch axis, "tp" for its head axis and "sp" for an axis that
                                follows the query positions (rows of a pattern); default () (no
                                state). `dllm_jax.attention.sharded.Sharded` runs `attend` per device;
  query_block                -> the queries that share one row of the state (a pattern's query block),
                                1 by default: sequence parallelism needs each device's slice to be
                                whole rows.
  at_layer(layer)            -> the policy as it attends at layer `layer` (a Python int: the unrolled
                                layers of the cached path know it while tracing); MAGE fixes its exact
                                layers there instead of reading a per-layer flag from its state;
                                default: itself;
  later_steps_sparse()       -> True when every forward of an SDAR block after its first runs SPARSE,
                                whatever the rows' progress (MAGE); the block loop then passes that
                                mode as a Python int. Default: False (`block_mode` decides per row).
  first_steps_estimate()     -> True when the first forward of every SDAR block may run ESTIMATE in every row,
                                rows that wait included (MAGE: such a row selects afresh for its own cache,
                                which is what its next forwards read); the block loop then passes ESTIMATE as
                                a Python int. Default: False (`block_mode` decides per row).
  commits_sparse()           -> True when every commit of a finished SDAR block runs SPARSE (MAGE: its
                                `block_mode(..., commit=True)`); the loops then pass the commit's mode
                                as a Python int. Default: False.

A mode or layer known while tracing (a Python int) lets a policy pick its branch in Python: one branch
compiled and run, no conditional per layer (on a GPU each conditional in a block step's layers leaves the
device idle for about 0.1 ms).
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dllm_jax import validation
from dllm_jax.attention import backends, kernels


class Mode(enum.IntEnum):
    DENSE = 0  # exact attention, the policy's state untouched
    ESTIMATE = 1  # exact attention that (re)builds the pattern
    SPARSE = 2  # the cheap step: reuses the pattern or cached partial results
    REFRESH = 3  # exact attention that refreshes cached partial results, keeping the pattern


@dataclasses.dataclass(frozen=True)
class AttentionPolicy(abc.ABC):
    """Base of every attention policy: the required `mode` and `attend`, a default for each optional
    hook (see the module docstring). Subclasses are frozen dataclasses (static, hashable)."""

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

    def at_layer(self, layer: int) -> "AttentionPolicy":
        return self

    def later_steps_sparse(self) -> bool:
        return False

    def first_steps_estimate(self) -> bool:
        return False

    def commits_sparse(self) -> bool:
        return False

    def deferring(self) -> "AttentionPolicy | None":
        """A variant of this policy whose forward at a block's start, every row estimating (a Python int mode), leaves
        per-layer states of another structure for `settle` to finish all layers at once (MAGE: its scores, for one
        batched top k); None (the default) where each layer finishes its own."""
        return None

    def settle(self, layers: tuple) -> tuple:
        """The deferring variant's states after that forward, one entry per layer, finished: the structure the
        policy's states have everywhere else."""
        return layers

    def joins_segments(self, q, k) -> bool:
        """Whether the segments of one cached forward (a finished block's commit riding on the next block's first
        step: queries q [B, Nq, Hq, D] of all segments, one layer's cache k) attend in one call, `kv_len` then a
        fill length per query [B, Nq] and the mode the last segment's, so the cache is read once (False, the
        default: one call per segment, each in its own mode)."""
        return False

    def pattern_mask(self, state, *, num_queries: int, num_keys: int, num_heads: int):
        return None

    def selection(self, state):
        return None

    def attend_window(self, q, k, v, state, mode, *, start, **masks):
        raise ValueError(f"{type(self).__name__} does not attend over a KV cache window (Fast-dLLM cache=): "
                         "use Dense, SparseD or PulseCol")

    def state_partition(self) -> Any:
        return ()

    @property
    def query_block(self) -> int:
        return 1


def field_label(policy, name: str) -> str:
    """"MAGE.k": how every refused configuration value is named."""
    return f"{type(policy).__name__}.{name}"


def check_field(policy, name: str, check, *, optional: bool = False, **bounds) -> None:
    """Replaces field `name` of a frozen policy by `check(field_label, value, **bounds)`, a
    `dllm_jax.validation` checker: a bad value raises ValueError at construction (not as a TypeError
    inside tracing, or as a silently different schedule), and a good one is stored in its canonical
    Python type, so that equal policies (static arguments of the jitted loops) hash the same whichever
    number type built them. `optional`: None is kept (a field that `bind` fills in)."""
    value = getattr(policy, name)
    if not (optional and value is None):
        object.__setattr__(policy, name, check(field_label(policy, name), value, **bounds))


def check_power_of_two(policy, name: str, minimum: int = 16) -> None:
    """A block size: an integer power of two >= minimum (the kernels' tiles)."""
    check_field(policy, name, validation.integer, minimum=None)
    value = getattr(policy, name)
    if value < minimum or value & (value - 1):
        raise ValueError(f"{field_label(policy, name)}={value} must be a power of two >= {minimum}")


def check_backend(policy, choices: tuple[str, ...] = backends.METHOD_BACKENDS) -> None:
    """The policy's `backend` field: one of `choices` (a subset of `backends.BACKENDS`), else a
    ValueError naming the field and the choices."""
    backends.check(policy.backend, field_label(policy, "backend"), choices)


@dataclasses.dataclass(frozen=True)
class Dense(AttentionPolicy):
    """The default policy: exact attention, no state.

    backend: one of `backends.BACKENDS`, resolved per call by `backends.dense` (the table there).
      "auto" (default): a block against a KV cache (`kv_len` and no other mask) on a GPU in
      bf16/fp16 runs the split-KV Pallas kernel (it reads the cache near copy bandwidth; cuDNN
      reads it at a fraction of that); every other call cuDNN flash attention on GPU for bf16/fp16,
      XLA otherwise. "reference" / "xla": the jnp attention for every call; "cudnn": cuDNN for every
      call; "triton" / "mosaic" / "interpret": the Pallas kernels for calls without a key or block
      mask (split-KV or flash), the dense default for masked ones.
    """

    backend: str = "auto"

    def __post_init__(self):
        check_backend(self, backends.BACKENDS)

    def mode(self, step):
        return Mode.DENSE

    def attend(self, q, k, v, state, mode, *, key_mask=None, mask=None, kv_len=None, scale=None):
        return kernels.attention(q, k, v, self.backend, key_mask=key_mask, mask=mask, kv_len=kv_len,
                                 scale=scale), state

    def joins_segments(self, q, k) -> bool:
        # where the split-KV kernel runs (the long caches): its fill length per query reads the cache once for
        # every segment; elsewhere one call per segment, as exact and no slower
        return backends.dense(self.backend, q, k, kv_len=0)[0] == "split_kv"

    def attend_window(self, q, k, v, state, mode, *, start, **masks):
        # cuDNN under "auto", as every call without a fill length: the split-KV kernel (kv_len = L) measured
        # no faster for LLaDA-8B's 32-query windows (459.6 vs 468.8 tok/s at 1k, 102.9 vs 101.2 at 8k, H200)
        return self.attend(q, k, v, state, mode, **masks)[0]


def window_rows(q, start, block: int, rows, attend):
    """Runs a pattern whose rows cover query blocks of `block` positions (from position 0) on a
    window of queries q [B, W, Hq, D] at positions start .. start + W - 1 (start traced).

    The window is placed at its offset inside the query blocks it touches (zero queries around it,
    a static count of blocks whatever the offset) and `attend(q_blocks, rows_of_those_blocks)` runs
    on them; `rows` is a pytree of arrays whose axis 2 is the query block ([B, H, blocks, ...] or
    [B, H, blocks]). Returns the window's rows of the result, [B, W, Hq, D]: each query gets exactly
    the keys its own block's row lists, as in a full forward.
    """
    b, w, h, d = q.shape
    touched = (w - 1) // block + 2  # blocks a window of w rows can touch at any offset
    first = start // block
    offset = start - first * block
    padded = jax.lax.dynamic_update_slice_in_dim(jnp.zeros((b, touched * block, h, d), q.dtype), q, offset, axis=1)
    # edge rows past the pattern's last block keep the slice in range (their queries are zeros, dropped)
    rows = jax.tree.map(lambda r: jax.lax.dynamic_slice_in_dim(
        jnp.pad(r, [(0, 0), (0, 0), (0, touched)] + [(0, 0)] * (r.ndim - 3), mode="edge"), first, touched, axis=2),
        rows)
    return jax.lax.dynamic_slice_in_dim(attend(padded, rows), offset, w, axis=1)


def switch_rows(index, branches, operand):
    """`jax.lax.switch(index, branches, operand)` with one branch index per batch row.

    index: a Python int (the branch is called directly), int32 scalar or [1] (a plain switch) or int32 [B]. Every branch
    returns a pytree whose leaves all have the batch axis first; row b of the result is row b of
    branches[index[b]](operand). When all rows agree, one switch runs their branch alone (the common
    case costs what the scalar switch costs: one conditional). Otherwise each branch runs only if
    some row needs it (`lax.cond` on `any(index == m)`; a skipped branch gives zeros that no row
    takes) and every row takes its own branch's rows. Indices out of range are clamped, as
    `lax.switch` does. The branches appear twice in the program (alone and in the mixed path): more
    to compile, so that the uniform case has no extra conditionals.
    """
    if isinstance(index, int):  # known while tracing (a static mode): its branch alone, no conditional
        return branches[min(max(index, 0), len(branches) - 1)](operand)
    index = jnp.asarray(index, jnp.int32)
    if index.ndim == 0 or index.shape[0] == 1:  # one row: nothing to mix (and nothing more to compile)
        return jax.lax.switch(jnp.reshape(index, ()), branches, operand)
    index = jnp.clip(index, 0, len(branches) - 1)

    def mixed(operand):
        result = None
        for m, branch in enumerate(branches):
            shapes = jax.eval_shape(branch, operand)

            def skip(_, shapes=shapes):
                return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)

            taken = index == m
            out = jax.lax.cond(jnp.any(taken), branch, skip, operand)
            result = out if result is None else jax.tree.map(
                lambda new, old: jnp.where(jnp.reshape(taken, (-1,) + (1,) * (new.ndim - 1)), new, old), out, result)
        return result

    uniform = jnp.all(index == index[0])
    return jax.lax.switch(jnp.where(uniform, index[0], len(branches)), [*branches, mixed], operand)


def unmasked_since_refresh(unmasked, mode, newly_unmasked):
    """The count `block_mode` gets at the next forward: reset by any forward that was not SPARSE,
    then this forward's newly unmasked tokens added."""
    return jnp.where(jnp.asarray(mode) == int(Mode.SPARSE), unmasked, 0) + newly_unmasked


def stacked_state(policy: AttentionPolicy, num_layers: int, **shapes):
    """`policy.init_state(**shapes)` for every layer, stacked on a leading layer axis, then adjusted
    by `policy.stack_layers` where layers differ (e.g. MAGE's exact first layers)."""
    one = policy.init_state(**shapes)
    return policy.stack_layers(jax.tree.map(lambda s: jnp.broadcast_to(s, (num_layers, *jnp.shape(s))), one))


@struct.dataclass
class LayerStates:
    """A policy's states as one entry per layer (`unstack_states`): what a loop over the unrolled layers carries, so
    that a layer reads its state as it is (a layer's slice of a stacked state that feeds a kernel is a device copy
    per layer and forward on a GPU)."""

    layers: tuple


def unstack_states(states, num_layers: int) -> LayerStates:
    """Stacked states (a leading layer axis on every leaf) as `LayerStates`."""
    return LayerStates(layers=tuple(jax.tree.map(lambda s, i=i: s[i], states) for i in range(num_layers)))


def stack_states(states: LayerStates):
    """`LayerStates` as stacked states again."""
    return jax.tree.map(lambda *layers: jnp.stack(layers), *states.layers)


def attend_layer(policy: AttentionPolicy, mode, q, k, v, states, layer, **masks):
    """`policy.attend` on layer `layer`'s slice of the stacked states (or its entry of `LayerStates`, `layer` then
    a Python int); returns (out, states)."""
    if isinstance(states, LayerStates):
        out, new = policy.at_layer(layer).attend(q, k, v, states.layers[layer], mode, **masks)
        return out, states.replace(layers=states.layers[:layer] + (new,) + states.layers[layer + 1:])
    if isinstance(layer, int):  # the unrolled layers: what differs by layer is known while tracing
        policy = policy.at_layer(layer)
    state = jax.tree.map(lambda s: s[layer], states)
    out, new = policy.attend(q, k, v, state, mode, **masks)
    # a leaf the policy returns as it got it is not written back: each write is a copy (a device memcpy on a GPU:
    # ~10 per state array and output block in MAGE's loop at 128k, where its sparse steps change nothing)
    return out, jax.tree.map(lambda s, old, leaf: s if leaf is old else s.at[layer].set(leaf), states, state, new)


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
