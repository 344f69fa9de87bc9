"""The slot engine's device side: its state (`Slots`, every field with the slot axis first), what a step hands the
host (`Snapshot`), and the jitted programs over them: `insert` (prefill requests into free slots) and `step` (a
step of every busy slot). `dllm_jax.serve.engine.Engine` schedules them from the host."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dllm_jax.attention.policy import AttentionPolicy
from dllm_jax.generate.block_loop import (BlockProgress, DecodeCarry, SlotLoop, cache_capacity, decode_block,
                                          decode_forwards, no_pending_block)
from dllm_jax.generate.sampling import RowSampling, row_sampling
from dllm_jax.serve.requests import MAX_STOP_IDS


@struct.dataclass
class Slots:
    """The engine's device state: every field has the slot axis first."""

    carry: DecodeCarry  # row-local tokens, KV cache, pending commits, draws, decoded lengths, stops
    keys: jax.Array  # PRNG key per slot (its request's seed)
    lengths: jax.Array  # int32 [S]: prompt tokens of the slot's request
    block: jax.Array  # int32 [S]: the next block the slot decodes (row-local)
    last: jax.Array  # int32 [S]: one past the slot's last block
    busy: jax.Array  # bool [S]: a request occupies the slot
    rows: RowSampling  # [S] each: the slot's request's sampling values
    stop_ids: jax.Array  # int32 [S, K + MAX_STOP_IDS]: the model's K stop ids, then the request's own (-1 pads)
    progress: BlockProgress  # [S] each: how far the slot's block in progress has come (schedule="forward")


@struct.dataclass
class Snapshot:
    """What the host reads of a step's result: copies, so that the step's state can be donated to the next one
    while the host reads them (`Engine(overlap=True)`)."""

    block: jax.Array
    last: jax.Array
    stopped: jax.Array
    x: jax.Array
    decoded: jax.Array
    forwards: jax.Array  # int32 [S]: the denoising forwards each slot needed in this step (its draws)
    blocks: jax.Array  # int32 [S]: the blocks each slot finished
    ran: jax.Array  # int32 []: the forwards the step ran


# prompt positions per prefill chunk of an insert's width bucket: enough rows for the GEMMs to be compute-bound
INSERT_CHUNK = 512


def prefill_buckets(block_size: int, width: int, chunk: int = INSERT_CHUNK) -> tuple[int, ...]:
    """The static prompt lengths an insert prefills: one block, then doubling below `chunk`, `chunk` itself, `chunk`
    and one block, then the whole width (prefilled in chunks, as far as the prompt reaches): a prompt whose
    complete blocks fit a chunk (at most chunk + block_size - 1 tokens; a longer one is prefilled a chunk per step,
    `Engine.admit`) never prefills rows as wide as a slot."""
    buckets, n = [], block_size
    while n < min(chunk, width):
        buckets.append(n)
        n *= 2
    last = tuple(b for b in (chunk, chunk + block_size) if block_size <= chunk and b < width)
    return tuple(buckets) + last + (width,)


def init_slots(params, *, config, slots: int, width: int, policy: AttentionPolicy, loop: SlotLoop,
               block_length: int, cache_dtype=None) -> Slots:
    """Every slot free: masks, an empty cache of `width` positions plus one block of scratch (in whole
    128-key tiles, as `generate` allocates; in `cache_dtype`, default the weights'), the policy's initial state, no
    pending commit."""
    bl = block_length
    capacity = cache_capacity(width, bl)
    carry = DecodeCarry(x=jnp.full((slots, width), config.mask_token_id, jnp.int32),
                        cache=loop.init_cache(config, slots, capacity, cache_dtype or params["embed"].dtype),
                        policy_state=loop.init_policy_state(policy, config, slots, width, block_length=bl),
                        finished=no_pending_block(slots, bl), draws=jnp.zeros((slots,), jnp.int32),
                        decoded=jnp.zeros((slots,), jnp.int32), stopped=jnp.zeros((slots,), bool))
    zeros = lambda: jnp.zeros((slots,), jnp.int32)  # noqa: E731  (one buffer each: the step donates them)
    return Slots(carry=carry, keys=jax.random.split(jax.random.key(0), slots), lengths=zeros(), block=zeros(),
                 last=zeros(), busy=jnp.zeros((slots,), bool),
                 rows=jax.tree.map(jnp.asarray, row_sampling(slots, temperature=1.0)),
                 progress=BlockProgress(row_step=zeros(), unmasked=zeros()),
                 stop_ids=jnp.asarray(np.tile(stop_table(config, ()), (slots, 1))))


def stop_table(config, stop_ids: tuple[int, ...]) -> np.ndarray:
    """int32 [K + MAX_STOP_IDS]: a slot's stop ids, the model's K and then a request's own, padded with -1 (no
    token)."""
    table = np.full(len(config.stop_ids) + MAX_STOP_IDS, -1, np.int32)
    ids = (*config.stop_ids, *stop_ids)
    table[:len(ids)] = ids
    return table


def insert(params, state: Slots, slots, prompts, lengths, max_new_tokens, seeds, values: RowSampling, stop_ids, base,
           begin, *, config, loop: SlotLoop, block_length: int, chunk: int = INSERT_CHUNK, keep: bool = False):
    """Slots `slots` (int32 [k]; a slot may repeat with the same request's values, which pad a batch) take k requests:
    `prompts` int32 [k, bucket] (a multiple of the block size; row i's first `lengths[i]` tokens are its prompt) are
    prefilled together into the k-row cache `base`, whose rows replace the slots'; a slot's fill length is its
    complete prompt blocks (what lies past them is scratch, as in a left-padded `generate` batch), its tokens, draws,
    stop flag and pending commit start afresh, its key is its seed's, its sampling values its row of `values`
    (`RowSampling` [k]), its stop ids its row of `stop_ids` (rows of `Slots.stop_ids`). The prefill runs in chunks
    of about `chunk` positions over the rows, those the longest prompt's complete blocks need, from position `begin`:
    `base` holds the K/V of the positions below it (a prefix from the prefix cache, the slots' capacity wide; None:
    an empty cache of the bucket's width, and `begin` 0). Returns (the state, the k-row cache: with `keep`, padded to
    the slots' capacity for the prefix cache to keep)."""
    bl = block_length
    carry = state.carry
    width = carry.x.shape[1]
    first = lengths // bl
    if base is None:  # rows as wide as the bucket, not the slots' capacity: a burst of short prompts stays small
        base = loop.init_cache(config, prompts.shape[0], prompts.shape[1], carry.cache.k[0].dtype)
    cache = loop.prefill(loop.loop_params(params, config), prompts, base, first * bl, config=config,
                         block_length=bl, chunk_tokens=chunk, begin=begin)
    padded = jnp.pad(prompts, ((0, 0), (0, width - prompts.shape[1])))
    rows = jnp.where(jnp.arange(width)[None] < lengths[:, None], padded, config.mask_token_id)
    put = lambda big, new: big.at[slots, :new.shape[1]].set(new)  # noqa: E731  (past the bucket: scratch)
    new_cache = carry.cache.replace(k=jax.tree.map(put, carry.cache.k, cache.k),
                                    v=jax.tree.map(put, carry.cache.v, cache.v),
                                    length=carry.cache.length.at[slots].set(first * bl))
    finished = carry.finished.replace(pending=carry.finished.pending.at[slots].set(False))
    carry = carry.replace(x=carry.x.at[slots].set(rows), cache=new_cache, finished=finished,
                          draws=carry.draws.at[slots].set(0), decoded=carry.decoded.at[slots].set(first * bl),
                          stopped=carry.stopped.at[slots].set(False))
    state = state.replace(carry=carry, keys=state.keys.at[slots].set(jax.vmap(jax.random.key)(seeds)),
                          lengths=state.lengths.at[slots].set(lengths), block=state.block.at[slots].set(first),
                          last=state.last.at[slots].set(-(-(lengths + max_new_tokens) // bl)),
                          busy=state.busy.at[slots].set(True),
                          rows=jax.tree.map(lambda rows, value: rows.at[slots].set(value), state.rows, values),
                          progress=jax.tree.map(lambda a: a.at[slots].set(0), state.progress),
                          stop_ids=state.stop_ids.at[slots].set(stop_ids))
    if keep:
        def wide(rows):
            return jnp.pad(rows, [(0, 0), (0, carry.cache.max_length - rows.shape[1])] + [(0, 0)] * (rows.ndim - 2))
        cache = cache.replace(k=jax.tree.map(wide, cache.k), v=jax.tree.map(wide, cache.v))
    return state, cache


def step(params, state: Slots, *, config, options, policy: AttentionPolicy, loop: SlotLoop, block_length: int,
         schedule: str) -> tuple[Slots, Snapshot]:
    """Every busy slot that has a block left and no stop decodes: its next block (schedule "block"), or a block's
    worth of forwards at its own pace (schedule "forward", `decode_forwards`); (the state, its snapshot)."""
    before = state
    active = state.busy & (state.block < state.last) & ~state.carry.stopped
    common = dict(lengths=state.lengths, block_length=block_length, stop_ids=state.stop_ids,
                  config=config, options=options, policy=policy, sampler=loop.sampler, rows=state.rows)
    params = loop.loop_params(params, config)
    if schedule == "forward":
        forwards = loop.sampler.schedule(options, config, block_length).shape[0]  # a block's worth per step
        carry, progress, block, ran = decode_forwards(params, state.carry, state.progress, state.keys, state.block,
                                                      state.last, state.busy, forwards=forwards, **common)
        state = state.replace(carry=carry, progress=progress, block=block)
    else:
        carry = decode_block(params, state.carry, state.keys, state.block, active, **common)
        # the block's first forward runs whether or not a row denoises in it
        ran = jnp.where(jnp.any(active), jnp.maximum(1, jnp.max(carry.draws - state.carry.draws)), 0)
        state = state.replace(carry=carry, block=jnp.where(active, state.block + 1, state.block))
    needed = jnp.where(active, state.carry.draws - before.carry.draws, 0)  # a row draws once per denoising forward
    return state, Snapshot(block=state.block, last=state.last, stopped=state.carry.stopped, x=state.carry.x,
                           decoded=state.carry.decoded, forwards=needed, blocks=state.block - before.block, ran=ran)


# how a step advances the slots: "block" (each busy slot decodes its next block; the step lasts until the slowest
# slot's block is unmasked) or "forward" (a block's worth of forwards, each slot at its own pace: `decode_forwards`)
SCHEDULES = ("block", "forward")


insert_program = jax.jit(insert, static_argnames=("config", "loop", "block_length", "chunk", "keep"),
                         donate_argnames=("state",))
step_program = jax.jit(step, static_argnames=("config", "options", "policy", "loop", "block_length", "schedule"),
                    donate_argnames=("state",))


def prefill_rows(params, prompts, cache, end, begin, *, config, loop: SlotLoop, block_length: int, chunk: int):
    """`cache` (k rows) with the K/V of `prompts` [k, bucket] written at positions begin..end[i] - 1: a part of a
    long prompt's prefill, which runs a chunk per engine step (`dllm_jax.serve.engine.Engine.admit`)."""
    return loop.prefill(loop.loop_params(params, config), prompts, cache, end, config=config, block_length=block_length,
                        chunk_tokens=chunk, begin=begin)


prefill_program = jax.jit(prefill_rows, static_argnames=("config", "loop", "block_length", "chunk"))
