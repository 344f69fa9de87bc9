"""The block-diffusion loop every block-diffusion family runs (SDAR / TraDo: `dllm_jax.generate.sdar`; LLaDA2:
`dllm_jax.generate.llada2`; the serving engine's slots: `dllm_jax.serve.engine`). A family plugs in what differs
as a `BlockSampler` (its per-step transfer counts, its sample-and-commit rule, its model's block steps) and, for
serving, a `SlotLoop`.

`denoise_block` runs one block's denoising forwards against the KV cache in a `lax.while_loop` (their number per
block is dynamic); `decode_blocks` scans over blocks (iterations after every row stopped are skipped by
`lax.cond`); `decode_forwards` is a serving step scheduled by forward, each row at its own block.

A finished block's commit (the forward that writes its K/V to the cache) rides on the next block's first step:
one forward over both blocks, the finished one attending as its own commit forward would (the block-causal mask
keeps the next block out of its view), the next one as its first step would (the sampler's `commit_and_step`).
That reads the weights once instead of twice per block with the same results.

Rows work in row-local coordinates: row b's tokens are shifted left by its padding (position j = its j-th real
token), its cache fills from position 0, and its blocks start at multiples of the block length from its first
real token, so rows whose prompts end in different blocks sit at different positions (the block steps take
per-row positions and cache lengths). Within a block all rows step together; a row whose block is finished
waits (its forwards are discarded, its policy state kept: it runs the SPARSE mode) until every row is finished
or the step limit is reached. A row commits with the mode its own step count gives and draws its random numbers
from its own counter, so every row computes exactly what generating it alone computes.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dllm_jax.attention.policy import AttentionPolicy, Dense, Mode, stack_states, unmasked_since_refresh, unstack_states
from dllm_jax.generate.requests import until_stop
from dllm_jax.generate.sampling import RowSampling
from dllm_jax.models.block_diffusion import KVCache, write_rows

CACHE_TILE = 128


@struct.dataclass
class RowBlock:
    """Each row's block in progress (per-row fields [B])."""

    cur: jax.Array  # int32 [B, block_size]: the block being denoised
    draws: jax.Array  # int32 [B]: random draws of each row so far (its key is folded with it)
    row_step: jax.Array  # int32 [B]: denoising forwards of each row in this block
    unmasked: jax.Array  # int32 [B]: block tokens unmasked since the row's last forward that was not SPARSE


@struct.dataclass
class BlockCarry:
    """The carry of the while loop over one block's denoising forwards."""

    rows: RowBlock
    cache: KVCache
    policy_state: Any  # the attention policy's per-layer state (leading layer axis)
    step: jax.Array  # int32 []: forwards of this block so far


@struct.dataclass
class Finished:
    """A decoded block whose commit rides on the next block's first forward."""

    ids: jax.Array  # int32 [B, block_size]
    pending: jax.Array  # bool [B]: the row has a block to commit
    mode: jax.Array  # int32 [B]: the policy mode of its commit (`block_mode(..., commit=True)`)


@struct.dataclass
class DecodeCarry:
    """The carry of the scan over blocks (row-local coordinates, see the module docstring)."""

    x: jax.Array  # int32 [B, width]: prompt, decoded blocks, masks
    cache: KVCache
    policy_state: Any
    finished: Finished
    draws: jax.Array  # int32 [B]
    decoded: jax.Array  # int32 [B]: length of each row's decoded prefix
    stopped: jax.Array  # bool [B]: a stop token has been generated


@dataclasses.dataclass(frozen=True)
class BlockSampler:
    """What a block-diffusion sampler plugs into the shared loops (`denoise_block`, `decode_blocks`): every
    field a module-level function, so a BlockSampler hashes and compares by them (a static argument)."""

    schedule: Callable  # (options, config, n) -> int32 [steps]: tokens to commit at each forward of a block of n
    # (logits, u, mask_index, count, options, rows: RowSampling | None) -> (tokens int32 [B, n], transfer bool [B, n])
    commit: Callable
    commit_and_step: Callable  # the model's `commit_and_step` (`dllm_jax.models.block_diffusion.commit_and_step`)
    block_step: Callable  # the model's `block_step`


@dataclasses.dataclass(frozen=True)
class SlotLoop:
    """What the serving engine (`dllm_jax.serve.engine`) needs of a block-diffusion family to keep requests in
    slots: the pieces of the family's `generate` loop, every field a module-level function or a constant (the
    engine's jitted insert and step take it as a static argument)."""

    sampler: BlockSampler
    loop_params: Callable  # (params, config) -> the parameters the loop's forwards take
    init_cache: Callable  # the model's init_cache(config, batch, capacity, dtype)
    prefill: Callable  # the model's prefill(params, ids, cache, lengths, *, config, block_length, chunk_tokens)
    init_policy_state: Callable  # the model's init_policy_state(policy, config, batch, width, *, block_length)
    block_length: Callable  # (config, options) -> the loop's block length
    # (config, prompt int32 [1, P], max_new_tokens, options) -> None: a ValueError naming what generate would
    # refuse in this request (P = 0: the options alone)
    check_request: Callable
    greedy: tuple[tuple[str, Any], ...]  # the options that decode greedily (a server's temperature 0)
    cuts_answer: bool  # generate's answer ends at max_new_tokens (else at the end of its last block)


def denoise_block(params, cur, cache, policy_state, key, draws, active, finished: Finished, *, config,
                  options, policy: AttentionPolicy = Dense(), sampler: BlockSampler,
                  rows: RowSampling | None = None):
    """Denoises one block per row, cur int32 [B, bl], against the cache until no active row (bool [B]
    `active`) has a mask left or the step limit (the length of `sampler.schedule`) is reached; forward j
    of a row commits `sampler.commit(..., count=schedule[j])` of its masked positions (`config` and `options`
    are the sampler's family's).

    The first forward also commits `finished` (the previous block of each row that has one pending:
    `sampler.commit_and_step`). Each forward's policy mode comes from
    `policy.block_mode(row_step, unmasked=..., commit=False)`, with `unmasked` the block tokens
    unmasked since the row's last forward whose mode was not SPARSE; rows that wait (finished or
    inactive) run SPARSE. `key` is one PRNG key for every row or a key per row ([B]: a serving slot's
    own seed); `draws` int32 [B] counts each row's random draws so far; `rows`, if given, each row's own
    temperature and top-p (`sampler.commit`'s). Returns
    (cur, cache, policy_state, draws, Finished of this block: pending where active, with the
    commit mode each row's own progress gives).
    """
    b, n = cur.shape
    sample, steps = bound_sampler(key, b, n, config=config, options=options, sampler=sampler, rows=rows)
    # unrolled layers carry one state per layer through the block's forwards (no per-layer slice of a stacked state)
    per_layer = isinstance(params["layers"], tuple) and bool(jax.tree.leaves(policy_state))
    if per_layer:
        policy_state = unstack_states(policy_state, len(params["layers"]))

    def denoising_rows(s: BlockCarry):
        return jnp.any(s.rows.cur == config.mask_token_id, axis=1) & active

    zeros = jnp.zeros((b,), jnp.int32)
    s = BlockCarry(rows=RowBlock(cur=cur, draws=draws, row_step=zeros, unmasked=zeros), cache=cache,
                   policy_state=policy_state, step=jnp.int32(0))
    denoising = denoising_rows(s)
    # a Python int where every row's first forward may estimate: the policy's per-layer switch is then no conditional
    mode = int(Mode.ESTIMATE) if policy.first_steps_estimate() else row_modes(policy, s.rows, denoising)
    # where the policy finishes that forward's work for all layers at once (`deferring`: MAGE's batched top k)
    deferring = policy.deferring() if per_layer and isinstance(mode, int) else None
    logits, cache, policy_state = sampler.commit_and_step(params, finished.ids, finished.pending & active, cur,
                                                          s.cache, s.policy_state, static_commit_mode(policy, finished),
                                                          mode, config=config,
                                                          policy=policy if deferring is None else deferring)
    if deferring is not None:
        policy_state = policy_state.replace(layers=deferring.settle(policy_state.layers))
    s = s.replace(rows=sample(s.rows, logits, mode, denoising), cache=cache, policy_state=policy_state,
                  step=jnp.int32(1))

    def body(s: BlockCarry) -> BlockCarry:
        denoising = denoising_rows(s)
        # a row denoising here is past its block's first forward, and a waiting row runs SPARSE: where the
        # policy's later steps are all SPARSE the mode is a Python int, and its per-layer switch no conditional
        mode = int(Mode.SPARSE) if policy.later_steps_sparse() else row_modes(policy, s.rows, denoising)
        logits, cache, policy_state = sampler.block_step(params, s.rows.cur, s.cache, s.policy_state, mode,
                                                         config=config, policy=policy)
        return s.replace(rows=sample(s.rows, logits, mode, denoising), cache=cache, policy_state=policy_state,
                         step=s.step + 1)

    # the official loops denoise for at most `steps` forwards, then commit
    s = jax.lax.while_loop(lambda s: jnp.any(denoising_rows(s)) & (s.step < steps), body, s)
    r = s.rows
    policy_state = stack_states(s.policy_state) if per_layer else s.policy_state
    return r.cur, s.cache, policy_state, r.draws, Finished(ids=r.cur, pending=active, mode=commit_modes(policy, r, b))


def row_modes(policy: AttentionPolicy, r: RowBlock, denoising):
    """Each row's policy mode for its next forward: from its progress where it denoises, SPARSE where it waits."""
    return jnp.where(denoising, policy.block_mode(r.row_step, unmasked=r.unmasked, commit=False), int(Mode.SPARSE))


def static_commit_mode(policy: AttentionPolicy, finished: Finished):
    """The mode the pending commits run in: a Python int where the policy's commits are all SPARSE (its per-layer
    switch then no conditional: `switch_rows`), else each row's own."""
    return int(Mode.SPARSE) if policy.commits_sparse() else finished.mode


def commit_modes(policy: AttentionPolicy, r: RowBlock, batch: int):
    """int32 [B]: the mode each row's finished block commits in (its own progress gives it)."""
    return jnp.broadcast_to(policy.block_mode(r.row_step, unmasked=r.unmasked, commit=True), (batch,)).astype(
        jnp.int32)


def bound_sampler(key, batch: int, n: int, *, config, options, sampler: BlockSampler, rows: RowSampling | None):
    """(`sample_rows` bound to a loop's PRNG key (one, or one per row), schedule for blocks of n and options;
    the schedule's count of forwards)."""
    schedule = sampler.schedule(options, config, n)
    sample = functools.partial(sample_rows, keys=jnp.broadcast_to(key, (batch,)), schedule=schedule, config=config,
                               options=options, sampler=sampler, rows=rows)
    return sample, schedule.shape[0]


def sample_rows(r: RowBlock, logits, mode, denoising, *, keys, schedule, config, options, sampler: BlockSampler,
                rows: RowSampling | None) -> RowBlock:
    """One denoising forward's commit in every row where `denoising` (bool [B]): forward j of a row commits
    `sampler.commit(..., count=schedule[j])` of its masked positions, drawing its uniforms from its key folded
    with its draw count; the other rows are left as they are."""
    n = r.cur.shape[1]
    steps = schedule.shape[0]
    mask_index = r.cur == config.mask_token_id
    u = jax.vmap(lambda k, t: jax.random.uniform(jax.random.fold_in(k, t), (1, n), jnp.float32)[0])(keys, r.draws)
    count = schedule[jnp.minimum(r.row_step, steps - 1)]
    x0, transfer = sampler.commit(logits, u, mask_index, count, options, rows)
    transfer = transfer & denoising[:, None]
    unmasked = unmasked_since_refresh(r.unmasked, mode, jnp.sum(transfer, axis=1, dtype=jnp.int32))
    step = denoising.astype(jnp.int32)
    return r.replace(cur=jnp.where(transfer, x0, r.cur), draws=r.draws + step, row_step=r.row_step + step,
                     unmasked=jnp.where(denoising, unmasked, r.unmasked))


def row_slices(x, starts, width: int):
    """int32 [B, width]: row b of x from column starts[b] (clamped inside x)."""
    return jax.vmap(lambda row, s: jax.lax.dynamic_slice_in_dim(row, s, width))(x, starts)


def decode_block(params, carry: DecodeCarry, key, block, active, *, lengths, block_length: int, stop_ids, config,
                 options, policy: AttentionPolicy, sampler: BlockSampler,
                 rows: RowSampling | None = None) -> DecodeCarry:
    """Decodes block `block[b]` (int32 [B], row-local) of every row where `active` (bool [B]) by
    `denoise_block` and writes it into carry.x: one iteration of `decode_blocks`, and a serving engine's
    step over its slots (each slot at its own block). A row stops once a stop token (int32 `stop_ids`)
    appears at or past lengths[b]; inactive rows keep their tokens, decoded length and pending commit
    state as `denoise_block` leaves them."""
    bl = block_length
    width = carry.x.shape[1]
    starts = jnp.minimum(block * bl, width - bl)
    cur = row_slices(carry.x, starts, bl)
    cur, cache, policy_state, draws, finished = denoise_block(
        params, cur, carry.cache, carry.policy_state, key, carry.draws, active, carry.finished, config=config,
        options=options, policy=policy, sampler=sampler, rows=rows)
    return carry.replace(x=placed(carry.x, cur, starts, active), cache=cache, policy_state=policy_state,
                         finished=finished, draws=draws, decoded=jnp.where(active, (block + 1) * bl, carry.decoded),
                         stopped=carry.stopped | stops(cur, starts, active, lengths=lengths, stop_ids=stop_ids))


def placed(x, cur, starts, where):
    """x int32 [B, width] with each row's block cur [B, n] written at its starts[b], in the rows `where`."""
    return jnp.where(where[:, None], write_rows(x, cur, starts), x)


def stops(cur, starts, where, *, lengths, stop_ids):
    """bool [B]: rows `where` whose block cur [B, n] at starts[b] holds a stop token at or past lengths[b]; stop_ids
    int32 [K] for every row, or [B, K] each row's own."""
    generated = starts[:, None] + jnp.arange(cur.shape[1]) >= lengths[:, None]
    table = jnp.broadcast_to(stop_ids, (cur.shape[0], stop_ids.shape[-1]))
    stopping = jnp.any(cur[:, :, None] == table[:, None, :], axis=-1)
    return where & jnp.any(stopping & generated, axis=1)


@struct.dataclass
class BlockProgress:
    """How far each row's block in progress has come between `decode_forwards` calls (per-row fields [B])."""

    row_step: jax.Array  # int32 [B]: denoising forwards of the row's current block so far
    unmasked: jax.Array  # int32 [B]: its tokens unmasked since the row's last forward that was not SPARSE


@struct.dataclass
class ForwardCarry:
    """The carry of `decode_forwards`' loop."""

    decode: DecodeCarry
    progress: BlockProgress
    block: jax.Array  # int32 [B]: each row's current block (row-local)
    ran: jax.Array  # int32 []: forwards so far


def decode_forwards(params, carry: DecodeCarry, progress: BlockProgress, key, block, last, live, *, forwards: int,
                    lengths, block_length: int, stop_ids, config, options, policy: AttentionPolicy,
                    sampler: BlockSampler, rows: RowSampling | None = None):
    """Up to `forwards` forwards in which every live row (bool [B] `live`, below its `last` block, not stopped)
    takes its own next denoising forward: a serving engine's step scheduled by forward rather than by block. A
    row whose block is done (no mask left, or the schedule's forwards spent: `denoise_block`'s exit, per row)
    writes it into carry.x, checks it for stop tokens as `decode_block` does and moves to its next block at
    its next forward, whose first step carries the finished block's commit (`sampler.commit_and_step`, every
    forward: rows with nothing pending step alone). So a row never waits for slower rows' blocks, and its
    forwards, modes, draws and commits are those `decode_block` gives it: its tokens are `generate`'s for its
    prompt alone. The block in progress lives in carry.x (masks where still masked) and `progress`.
    Returns (carry, progress, block, forwards run: int32 [])."""
    bl = block_length
    b, width = carry.x.shape
    sample, steps = bound_sampler(key, b, bl, config=config, options=options, sampler=sampler, rows=rows)

    def active_rows(c: ForwardCarry):
        return live & (c.block < last) & ~c.decode.stopped

    def forward(c: ForwardCarry) -> ForwardCarry:
        d, active = c.decode, active_rows(c)
        starts = jnp.minimum(c.block * bl, width - bl)
        r = RowBlock(cur=row_slices(d.x, starts, bl), draws=d.draws, row_step=c.progress.row_step,
                     unmasked=c.progress.unmasked)
        denoising = jnp.any(r.cur == config.mask_token_id, axis=1) & active
        mode = row_modes(policy, r, denoising)
        pending = d.finished.pending & active
        logits, cache, policy_state = sampler.commit_and_step(params, d.finished.ids, pending, r.cur, d.cache,
                                                              d.policy_state, static_commit_mode(policy, d.finished),
                                                              mode, config=config, policy=policy)
        r = sample(r, logits, mode, denoising)
        done = active & (~jnp.any(r.cur == config.mask_token_id, axis=1) | (r.row_step >= steps))
        finished = Finished(ids=jnp.where(done[:, None], r.cur, d.finished.ids),
                            pending=done | (d.finished.pending & ~active),  # the active rows' commits ran above
                            mode=jnp.where(done, commit_modes(policy, r, b), d.finished.mode))
        zeros = jnp.zeros_like(r.row_step)
        return ForwardCarry(
            decode=d.replace(x=placed(d.x, r.cur, starts, active), cache=cache, policy_state=policy_state,
                             finished=finished, draws=r.draws, decoded=jnp.where(done, (c.block + 1) * bl, d.decoded),
                             stopped=d.stopped | stops(r.cur, starts, done, lengths=lengths, stop_ids=stop_ids)),
            progress=BlockProgress(row_step=jnp.where(done, zeros, r.row_step),
                                   unmasked=jnp.where(done, zeros, r.unmasked)),
            block=jnp.where(done, c.block + 1, c.block), ran=c.ran + 1)

    c = ForwardCarry(decode=carry, progress=progress, block=block, ran=jnp.int32(0))
    c = jax.lax.while_loop(lambda c: jnp.any(active_rows(c)) & (c.ran < forwards), forward, c)
    return c.decode, c.progress, c.block, c.ran


def no_pending_block(batch: int, block_length: int) -> Finished:
    """No row has a finished block waiting for its commit."""
    return Finished(ids=jnp.zeros((batch, block_length), jnp.int32), pending=jnp.zeros((batch,), bool),
                    mode=jnp.full((batch,), int(Mode.SPARSE), jnp.int32))


def decode_blocks(params, x, cache, policy_state, key, *, lengths, first, last, iterations: int, block_length: int,
                  stop_ids, config, options, policy: AttentionPolicy, sampler: BlockSampler, on_step=None,
                  run_id=0, rows: RowSampling | None = None) -> DecodeCarry:
    """The scan over blocks shared by the block-diffusion samplers, in row-local coordinates (module
    docstring): iteration i decodes row b's block first[b] + i of x int32 [B, width] (prompt, then masks)
    by `decode_block` (with `sampler`) while it is below last[b] and no stop token (int32 `stop_ids`)
    appeared at or past lengths[b]. `on_step(run_id, i)` (static), if given, is called on the host after
    every iteration; `rows`, if given, the rows' traced sampling values (`sampler.commit`'s). Returns the final
    DecodeCarry."""
    b = x.shape[0]

    def decode(carry: DecodeCarry, i) -> DecodeCarry:
        block = first + i
        carry = decode_block(params, carry, key, block, (block < last) & ~carry.stopped, lengths=lengths,
                             block_length=block_length, stop_ids=stop_ids, config=config, options=options,
                             policy=policy, sampler=sampler, rows=rows)
        if on_step is not None:
            # a count needs no ordering, and an unordered callback adds no sync point per step
            jax.debug.callback(on_step, run_id, i, ordered=False)
        return carry

    def per_block(carry: DecodeCarry, i):
        idle = jnp.all(carry.stopped | (first + i >= last))
        return jax.lax.cond(idle, lambda carry, i: carry, decode, carry, i), None

    carry = DecodeCarry(x=x, cache=cache, policy_state=policy_state, finished=no_pending_block(b, block_length),
                        draws=jnp.zeros((b,), jnp.int32), decoded=first * block_length, stopped=jnp.zeros((b,), bool))
    carry, _ = jax.lax.scan(per_block, carry, jnp.arange(iterations, dtype=jnp.int32))
    return carry


def cache_capacity(width: int, block_length: int) -> int:
    """The KV cache length the block loop allocates for rows of `width` positions: the rows plus one block
    of scratch for idle rows' writes, in whole CACHE_TILE-key tiles (what the split-KV kernels read; a
    benchmark allocating another capacity times another program)."""
    return -(-(width + block_length) // CACHE_TILE) * CACHE_TILE


def trim(x, end, prompt_lengths, stop_ids) -> list:
    """Host-side: each row of x (row-local) cut after its first stop token in the generated part
    (kept), else at its end."""
    rows = []
    for row, e, p in zip(x, end, prompt_lengths):
        row = np.asarray(row[: int(e)])
        rows.append(np.concatenate([row[: int(p)], until_stop(row[int(p):], stop_ids)]))
    return rows
