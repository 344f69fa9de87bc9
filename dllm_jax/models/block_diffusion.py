"""The block-diffusion LM every block-diffusion family runs (SDAR / TraDo: `dllm_jax.models.sdar`; LLaDA2:
`dllm_jax.models.llada2`): block-causal attention and an exact KV cache.

Attention is bidirectional inside each block of `block_length` tokens and causal across blocks, so
the keys and values of finished blocks never change: a cache of them is exact, not an approximation.

Two forward paths, both attending through an attention policy (`Dense()` by default):
  * `forward(params, ids)`: the full sequence under the block-causal mask (training-style view);
  * cached inference over a preallocated, static-shaped `KVCache` (one [B, max_length, Hkv, D]
    buffer per layer, plus a fill length per row): `prefill` writes the complete prompt blocks,
    `block_step` runs one block against the cache (a denoising step), and
    `block_step(..., commit=True)` appends the finished block by advancing the fill lengths.

`block_step` writes the block's own K/V into the cache slots just past each row's fill length, then
attends over one contiguous buffer of `length + n` keys. The filled prefix is never written, and a
non-committing step leaves the fill length unchanged, so the cache's contents (positions below the
fill length) are exactly those before the step; the slots beyond are scratch. This avoids copying
the whole cache to concatenate the block to it (what SDAR's torch code does with `store_kv=False`);
inside a jitted loop the update happens in place. Rows of a batch may sit at different positions
(batched generation keeps each row's own block alignment): positions, writes and `kv_len` are per
row. The cached path runs the layers unrolled (each layer's cache is its own buffer, indexed by a
static layer number); parameters in the scan layout are sliced into layers first.

A family plugs in a `BlockDecoder` (its decoder stack, RoPE tables and parameter preparation), which every
function here takes as `decoder`; `BlockDiffusionLM` holds the host-side methods (input checks, the jitted
calls) of the families' modules.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct

from dllm_jax.attention import kv_rows
from dllm_jax.attention.kv_rows import write_rows
from dllm_jax.attention.policy import AttentionPolicy, Dense, Mode, attend_layer, check_policy, stacked_state
from dllm_jax.config import DecoderConfig
from dllm_jax.models.layers import DecoderLM, check_inputs, inference_layers, lm_head, lm_param_shapes
from dllm_jax.sharding import shard_kv_cache

param_shapes = lm_param_shapes


@struct.dataclass
class KVCache:
    """Keys/values of the finished prefix, static-shaped; positions >= a row's `length` are scratch."""

    k: tuple  # per layer: [B, max_length, Hkv, D]
    v: tuple  # per layer: [B, max_length, Hkv, D]
    length: jax.Array  # int32 [B]: filled positions per row

    @property
    def max_length(self) -> int:
        return self.k[0].shape[1]


def init_cache(config: DecoderConfig, batch: int, max_length: int, dtype=jnp.bfloat16) -> KVCache:
    """An empty cache; `dtype` `kv_rows.FP8` makes every layer's rows `kv_rows.QuantizedRows`."""
    shape = (batch, max_length, config.num_kv_heads, config.head_dim)
    layers = range(config.num_layers)
    return KVCache(tuple(kv_rows.zeros(shape, dtype) for _ in layers),
                   tuple(kv_rows.zeros(shape, dtype) for _ in layers), jnp.zeros((batch,), jnp.int32))


def replace_layer(layers: tuple, index: int, value) -> tuple:
    return layers[:index] + (value,) + layers[index + 1:]


def unrolled(params, config: DecoderConfig) -> dict:
    """params with its layers as a tuple of per-layer dicts (the cached path indexes layers statically)."""
    return dict(params, layers=inference_layers(params["layers"], config, execution="unrolled"))


def as_given(params, config: DecoderConfig) -> dict:
    """params unchanged: `layers.decoder_stack` takes every layout (the scan one runs as a scan)."""
    return params


@dataclasses.dataclass(frozen=True)
class BlockDecoder:
    """What a block-diffusion family plugs into this module's forward and cached path. Every field is a
    module-level function, so a BlockDecoder hashes and compares by those functions: a static jit argument."""

    decoder_stack: Callable  # (layers, x [B, L, d], cos, sin, attend, config, state) -> (x, state)
    rope_tables: Callable  # (positions int32 [...], config) -> fp32 (cos, sin) [..., rotated dims]
    full_params: Callable  # (params, config) -> the tree `forward` runs
    cached_params: Callable  # (params, config) -> the tree with per-layer dicts (the cached path indexes layers)


def block_causal_mask(n: int, block_length: int, positions=None):
    """bool [len(positions), n]: the query at position p may attend key j < n iff j's block is not after
    p's block; positions default to 0..n-1 (the square mask of a full forward)."""
    blocks = jnp.arange(n) // block_length
    query_blocks = blocks if positions is None else positions // block_length
    return blocks[None, :] <= query_blocks[:, None]


def forward(params, input_ids, policy_state=None, step=0, *, config: DecoderConfig, block_length: int | None = None,
            policy: AttentionPolicy = Dense(), decoder: BlockDecoder):
    """Full-sequence forward under the block-causal mask: int32 [B, L] -> (float32 logits [B, L, V],
    new policy_state), attention through `policy` at `step` (its state as in `llada.forward`).

    The last block may be partial (L need not be a multiple of the block length). `decoder` supplies
    the layers, RoPE and parameter preparation, here and in the cached path.
    """
    params = decoder.full_params(params, config)
    b, n = input_ids.shape
    if policy_state is None:
        policy_state = init_policy_state(policy, config, b, n, block_length=n)
    mask = block_causal_mask(n, block_length or config.block_size)
    mode = policy.mode(step)
    cos, sin = decoder.rope_tables(jnp.arange(n), config)

    def attend(q, k, v, states, layer):
        return attend_layer(policy, mode, q, k, v, states, layer, mask=mask)

    x, policy_state = decoder.decoder_stack(params["layers"], params["embed"][input_ids], cos, sin, attend, config,
                                    policy_state)
    return lm_head(params, x, config), policy_state


PREFILL_TOKENS = 16384  # query tokens per prefill chunk, all rows together


def prefill_chunk_length(batch: int, n: int, block_length: int, chunk_tokens: int = PREFILL_TOKENS) -> int:
    """Prompt positions per prefill chunk: whole blocks, about chunk_tokens / batch of them (at least
    one block), at most the prompt."""
    return min(n, max(block_length, chunk_tokens // batch // block_length * block_length))


def prefill(params, input_ids, cache: KVCache, lengths=None, *, config: DecoderConfig, block_length: int | None = None,
            policy: AttentionPolicy = Dense(), decoder: BlockDecoder,
            chunk_tokens: int = PREFILL_TOKENS, begin=0) -> KVCache:
    """Writes the K/V of the complete prompt blocks input_ids [B, P] (P % block_size == 0) at
    positions 0..P-1 and sets the fill lengths to `lengths` (int32 [B], multiples of the block size,
    <= P; default P): a row with fewer complete blocks than P has junk past its length, which is
    scratch (the block-causal mask keeps it out of the earlier positions' K/V).

    The prompt runs in chunks of whole blocks (`prefill_chunk_length`: about `chunk_tokens` query
    tokens per chunk over all rows), each attending to the cache under the block-causal mask, so a
    long prompt's activations (MoE dispatch buffers, attention masks) stay those of one chunk: one
    pass over 16 rows of 8k positions needed about 77 GB of temporaries for LLaDA2.0-mini. Only the
    chunks that cover the longest fill length run (a dynamic count: a serving engine's insert pads
    every long prompt to one static width and pays for its own length); the last chunk ends there
    (or at the chunk length) and may overlap the one before; positions written twice get the same K/V.
    `begin` (int32, a multiple of the block size; traced) is the first position to compute: the cache already
    holds the K/V of the positions below it (a prefix another prompt shared), and the chunks start there.

    The cache must hold exact keys and values, so `policy` runs in its DENSE mode, from its initial
    state (discarded). The blocks are `block_length` long (the config's block size by default).
    """
    params = decoder.cached_params(params, config)
    b, n = input_ids.shape
    bl = block_length or config.block_size
    chunk = prefill_chunk_length(b, n, bl, chunk_tokens)
    lengths = jnp.full((b,), n, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    end = jnp.max(lengths, initial=0)  # the filled positions: what lies past them is scratch
    policy_state = init_policy_state(policy, config, b, cache.max_length, block_length=chunk)

    def chunk_forward(i, cache: KVCache) -> KVCache:
        start = jnp.maximum(jnp.minimum(begin + i * chunk, end - chunk), 0)
        positions = start + jnp.arange(chunk)
        mask = block_causal_mask(cache.max_length, bl, positions)  # [chunk, max_length]
        cos, sin = decoder.rope_tables(positions, config)

        def attend(q, k, v, state, layer):
            cache, policy_state = state
            ck, cv = kv_rows.write_span(cache.k[layer], k, start), kv_rows.write_span(cache.v[layer], v, start)
            cache = cache.replace(k=replace_layer(cache.k, layer, ck), v=replace_layer(cache.v, layer, cv))
            out, policy_state = attend_layer(policy, Mode.DENSE, q, ck, cv, policy_state, layer, mask=mask)
            return out, (cache, policy_state)

        ids = jax.lax.dynamic_slice_in_dim(input_ids, start, chunk, axis=1)
        _, (cache, _) = decoder.decoder_stack(params["layers"], params["embed"][ids], cos, sin, attend, config,
                                             (cache, policy_state))
        return cache

    cache = jax.lax.fori_loop(0, (jnp.maximum(end - begin, 0) + chunk - 1) // chunk, chunk_forward, cache)
    return cache.replace(length=lengths)


@struct.dataclass
class Segment:
    """A run of block tokens in a cached forward: ids [B, n] at positions start[b].. of each row,
    attending through the policy in `mode` to the row's keys below start + n."""

    ids: jax.Array  # int32 [B, n]
    start: jax.Array  # int32 [B]
    mode: Any  # int32 scalar or [B]


def cached_forward(params, segments: tuple, cache: KVCache, policy_state, *, config: DecoderConfig,
                   policy: AttentionPolicy, decoder: BlockDecoder):
    """One forward over the concatenated segments against the cache: per layer, every segment's K/V
    is written at its positions (in order: a later segment overwrites an earlier one at the same
    positions), then each segment attends (in order, the policy state threaded through; all in one call where
    the policy `joins_segments`). Returns
    (float32 logits of the last segment [B, n, V], cache with the writes, policy_state); fill
    lengths unchanged."""
    params = decoder.cached_params(params, config)
    sizes = [seg.ids.shape[1] for seg in segments]
    bounds = [sum(sizes[:i]) for i in range(1, len(sizes))]
    positions = jnp.concatenate([seg.start[:, None] + jnp.arange(n) for seg, n in zip(segments, sizes)], axis=1)
    cos, sin = decoder.rope_tables(positions, config)

    def attend(q, k, v, state, layer):
        cache, policy_state = state
        ck, cv = cache.k[layer], cache.v[layer]
        parts = [jnp.split(x, bounds, axis=1) for x in (q, k, v)]
        for seg, k_seg, v_seg in zip(segments, parts[1], parts[2]):
            ck, cv = write_rows(ck, k_seg, seg.start), write_rows(cv, v_seg, seg.start)
        cache = cache.replace(k=replace_layer(cache.k, layer, ck), v=replace_layer(cache.v, layer, cv))
        if len(segments) > 1 and policy.joins_segments(q, ck):  # one pass over the cache, a fill length per query
            kv_len = jnp.concatenate([jnp.broadcast_to((seg.start + n)[:, None], (q.shape[0], n))
                                      for seg, n in zip(segments, sizes)], axis=1)
            out, policy_state = attend_layer(policy, segments[-1].mode, q, ck, cv, policy_state, layer, kv_len=kv_len)
            return out, (cache, policy_state)
        outs = []
        for seg, q_seg, n in zip(segments, parts[0], sizes):
            out, policy_state = attend_layer(policy, seg.mode, q_seg, ck, cv, policy_state, layer,
                                             kv_len=seg.start + n)
            outs.append(out)
        return jnp.concatenate(outs, axis=1), (cache, policy_state)

    ids = jnp.concatenate([seg.ids for seg in segments], axis=1)
    x, (cache, policy_state) = decoder.decoder_stack(params["layers"], params["embed"][ids], cos, sin, attend, config,
                                             (cache, policy_state))
    return lm_head(params, x[:, -sizes[-1]:], config), cache, policy_state


def block_step(params, block_ids, cache: KVCache, policy_state=None, mode=None, *, config: DecoderConfig,
               policy: AttentionPolicy = Dense(), commit=False, decoder: BlockDecoder):
    """One block of tokens block_ids [B, n], row b at positions length[b]..length[b]+n-1, against the cache.

    Every block token attends to its row's whole filled prefix and to every token of the block,
    through `policy`: it sees the layer's cache buffer with `kv_len` = length + n (int32 [B]).
    `mode` (int32 scalar or [B], from `policy.block_mode`) applies to every layer; None is the mode
    of a block's first forward. `policy_state` (leading layer axis; None: `init_policy_state`) is
    threaded like the cache. Returns (float32 logits [B, n, V], cache, policy_state); with
    commit=True (may be traced, scalar or bool [B]) the block is appended (the fill length
    advances by n), otherwise the cache's filled prefix and length are unchanged. Requires
    length + n <= max_length (checked by `BlockDiffusionLM.block_step` on concrete caches; inside jit,
    `dynamic_update_slice` would clamp the write position).
    """
    b, n = block_ids.shape
    if policy_state is None:
        policy_state = init_policy_state(policy, config, b, cache.max_length, block_length=n)
    if mode is None:
        mode = policy.block_mode(0, unmasked=jnp.zeros((b,), jnp.int32), commit=commit)
    segment = Segment(ids=block_ids, start=cache.length, mode=mode)
    logits, new_cache, policy_state = cached_forward(params, (segment,), cache, policy_state, config=config,
                                                     policy=policy, decoder=decoder)
    return logits, new_cache.replace(length=jnp.where(commit, cache.length + n, cache.length)), policy_state


def commit_and_step(params, finished_ids, pending, block_ids, cache: KVCache, policy_state, finished_mode, mode, *,
                    config: DecoderConfig, policy: AttentionPolicy = Dense(), decoder: BlockDecoder):
    """The commit of a finished block and the first step of the next one in one forward (the weights
    are read once for both): in rows where `pending` (bool [B]), finished_ids [B, n] are appended at
    length..length+n-1 (attending as a commit forward would, in `finished_mode`: int32 [B], or a Python int
    SPARSE that every row takes) and block_ids
    [B, n] step at the positions after them; in the other rows block_ids step at length.. as
    `block_step` would (their finished_ids are ignored). Returns (logits of block_ids [B, n, V],
    cache with the pending rows' lengths advanced by n, policy_state).

    Exact: under the block-causal mask the finished block never sees the next one, so its K/V are
    those of a separate commit forward, and the next block sees everything a separate step would.
    """
    n = block_ids.shape[1]
    start = cache.length + jnp.where(pending, n, 0)
    if not (isinstance(finished_mode, int) and finished_mode == int(Mode.SPARSE)):  # a static SPARSE is every row's
        finished_mode = jnp.where(pending, finished_mode, int(Mode.SPARSE))
    finished = Segment(ids=finished_ids, start=cache.length, mode=finished_mode)
    # a row without a pending block writes its block's K/V over the ignored segment's (same positions)
    logits, cache, policy_state = cached_forward(params, (finished, Segment(ids=block_ids, start=start, mode=mode)),
                                                 cache, policy_state, config=config, policy=policy, decoder=decoder)
    return logits, cache.replace(length=start), policy_state


def init_policy_state(policy: AttentionPolicy, config: DecoderConfig, batch: int, max_length: int, *,
                      block_length: int | None = None):
    """The policy's state for every layer: `block_length` queries (the config's block size by
    default) against `max_length` keys."""
    return stacked_state(policy, config.num_layers, batch=batch, num_heads=config.num_heads,
                         num_kv_heads=config.num_kv_heads, q_len=block_length or config.block_size,
                         kv_len=max_length, head_dim=config.head_dim)


@functools.partial(jax.jit, static_argnames=("config", "block_length", "policy", "decoder"))
def _logits_jit(params, input_ids, *, config: DecoderConfig, block_length: int | None, policy: AttentionPolicy,
                decoder: BlockDecoder):
    return forward(params, input_ids, config=config, block_length=block_length, policy=policy, decoder=decoder)[0]


_prefill_jit = jax.jit(prefill, static_argnames=("config", "block_length", "policy", "decoder"))
# one program for the whole empty cache: 2 x layers eager allocations cost SDAR-8B ~45 ms of host time on an H100,
# more than its 1k-token prefill's GPU time (docs/quantization.md)
_init_cache_jit = jax.jit(init_cache, static_argnames=("config", "batch", "max_length", "dtype"))


@functools.partial(jax.jit, static_argnames=("config", "commit", "policy", "decoder"))
def _block_step_jit(params, block_ids, cache: KVCache, *, config: DecoderConfig, commit: bool, policy: AttentionPolicy,
                    decoder: BlockDecoder):
    logits, cache, _ = block_step(params, block_ids, cache, config=config, commit=commit, policy=policy, decoder=decoder)
    return logits, cache


class BlockDiffusionLM(DecoderLM):
    """The host-side methods of a block-diffusion LM (a subclass sets its `decoder`, a class attribute).

    `model(input_ids)` is the full block-causal forward; `init_cache`, `prefill` and `block_step` are
    the cached path the block-diffusion loop runs. Each method checks its inputs on the host, takes an
    attention `policy` (`Dense()` by default) and runs it from its initial state (the pure functions
    of this module thread the state).
    """

    def __call__(self, input_ids, *, block_length: int | None = None, policy: AttentionPolicy = Dense()):
        """float32 logits [B, L, V] under the block-causal mask (block length from the config)."""
        input_ids = jnp.asarray(input_ids)
        check_inputs(self.config, input_ids)
        if block_length is not None and block_length <= 0:
            raise ValueError(f"block_length must be positive, got {block_length}")
        check_policy(policy)
        return _logits_jit(self.params(), input_ids, config=self.config, block_length=block_length, policy=policy,
                           decoder=self.decoder)

    def init_cache(self, batch: int, max_length: int) -> KVCache:
        """An empty cache for `batch` rows and up to `max_length` positions, in the model's dtype (on a
        sharded model: rows over "dp", KV heads over "tp")."""
        if batch <= 0 or max_length <= 0:
            raise ValueError(f"batch and max_length must be positive, got {batch=}, {max_length=}")
        return shard_kv_cache(_init_cache_jit(self.config, batch, max_length, self.dtype), self.mesh)

    def prefill(self, input_ids, cache: KVCache, *, policy: AttentionPolicy = Dense()) -> KVCache:
        """Fills an empty cache with the complete prompt blocks input_ids [B, P]."""
        input_ids = jnp.asarray(input_ids)
        check_inputs(self.config, input_ids)
        n, bs = input_ids.shape[1], self.config.block_size
        if n % bs:
            raise ValueError(f"prefill takes complete blocks: prompt length {n} is not a multiple of "
                             f"block_size={bs} (run the trailing {n % bs} tokens as the first block)")
        check_cache(cache, input_ids.shape[0], 0, n, self.config)
        check_policy(policy)
        return _prefill_jit(self.params(), input_ids, cache, config=self.config, policy=policy, decoder=self.decoder)

    def block_step(self, block_ids, cache: KVCache, *, commit: bool = False, policy: AttentionPolicy = Dense()):
        """(logits [B, n, V], cache) of one block against the cache; see `block_step`."""
        block_ids = jnp.asarray(block_ids)
        check_inputs(self.config, block_ids)
        check_cache(cache, block_ids.shape[0], None, block_ids.shape[1], self.config)
        check_policy(policy)
        return _block_step_jit(self.params(), block_ids, cache, config=self.config, commit=commit, policy=policy,
                               decoder=self.decoder)


def check_cache(cache: KVCache, batch: int, expected_length: int | None, n: int, config: DecoderConfig) -> None:
    """Host-side checks that a concrete cache fits this model, batch and write of n positions."""
    want = (batch, cache.max_length, config.num_kv_heads, config.head_dim)
    shapes = {tuple(x.shape) for x in (*cache.k, *cache.v)}
    if len(cache.k) != config.num_layers or len(cache.v) != config.num_layers or shapes != {want}:
        raise ValueError(f"cache of {len(cache.k)} layers shaped {sorted(shapes)} does not fit this model and batch "
                         f"(expected {config.num_layers} layers of {want})")
    if tuple(jnp.shape(cache.length)) != (batch,):
        raise ValueError(f"cache length must be int32 [batch] = [{batch}], got shape {jnp.shape(cache.length)}")
    if isinstance(cache.length, jax.core.Tracer):
        return
    lengths = [int(x) for x in cache.length]
    if expected_length is not None and any(length != expected_length for length in lengths):
        raise ValueError(f"prefill needs an empty cache, this one holds {lengths} positions")
    if max(lengths) + n > cache.max_length:
        raise ValueError(f"cache full: {max(lengths)} filled + {n} new positions > max_length {cache.max_length}")
