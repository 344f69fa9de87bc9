"""SDAR block-diffusion generation as one compiled loop (JetAstra/SDAR `block_diffusion_generate`).

The complete prompt blocks are prefilled into the KV cache; then each block (the first one may
hold the prompt's trailing tokens) is denoised by repeated block steps against the cache, a step
committing n[j] tokens by the remasking strategy, until no mask is left; one more forward then
appends the block to the cache (the commit). Generation stops after the block in which a stop
token appears. Blocks run in a `lax.scan` (finished blocks after a stop are skipped by `lax.cond`),
steps in a `lax.while_loop` (their number per block is dynamic).

Sampling follows generate.py: logits / T (if T != 1), top-k, top-p (the first token always kept),
softmax, one draw per position; the confidence is the drawn token's probability after filtering.
The draw is by inverse CDF from uniforms `uniform(fold_in(key(seed), t), [B, n])`, t counting the
denoising forwards from 0 (commit forwards draw nothing). Ties in confidence (e.g. top_k=1, where
every probability is 1) are broken towards the lower position; torch.topk leaves that order
unspecified.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from dllm_jax import validation as check
from dllm_jax.attention.policy import AttentionPolicy, Dense, check_policy, unmasked_since_refresh
from dllm_jax.config import SDARConfig
from dllm_jax.generate.sampling import sample_tokens, transfer_counts, transfer_mask
from dllm_jax.models import sdar as sdar_model

CACHE_TILE = 128
REMASKING = ("low_confidence_dynamic", "low_confidence_static", "sequential")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SDAROptions:
    """Static options of SDAR generation (a change recompiles); see `generate_sdar`."""

    max_new_tokens: int = 128
    denoising_steps: int = 4
    remasking: str = "low_confidence_dynamic"
    confidence_threshold: float = 0.85
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        def store(name, value):  # canonical int / float: equal options hash equal as static jit arguments
            object.__setattr__(self, name, value)

        for name in ("max_new_tokens", "denoising_steps"):
            store(name, check.integer(name, getattr(self, name)))
        check.choice("remasking", self.remasking, REMASKING)
        # the sampler divides the logits by T (T = inf would flatten them to uniform, NaN poisons them);
        # top_k = 0 and top_p = 1 switch the filters off; the threshold is compared with probabilities
        store("temperature", check.real("temperature", self.temperature, low=0, low_open=True,
                                        hint=" (the official sampler divides the logits by it; top_k=1 is greedy)"))
        store("top_k", check.integer("top_k", self.top_k, minimum=0, hint=" (0 turns the filter off)"))
        store("top_p", check.real("top_p", self.top_p, low=0, high=1, low_open=True))
        store("confidence_threshold", check.real("confidence_threshold", self.confidence_threshold, low=0, high=1))


@struct.dataclass
class BlockCarry:
    """The carry of the while loop over one block's forwards."""

    cur: jax.Array  # int32 [B, block_size]: the block being denoised
    cache: sdar_model.KVCache
    policy_state: Any  # the attention policy's per-layer state (leading layer axis)
    draws: jax.Array  # int32 []: random draws so far (the key is folded with it)
    done: jax.Array  # bool []: the commit forward has run
    step: jax.Array  # int32 []: forwards of this block so far
    unmasked: jax.Array  # int32 []: block tokens unmasked since the last forward that was not SPARSE


@struct.dataclass
class DecodeCarry:
    """The carry of the scan over blocks."""

    x: jax.Array  # int32 [B, total]: prompt, decoded blocks, masks
    cache: sdar_model.KVCache
    policy_state: Any
    draws: jax.Array  # int32 []
    stopped: jax.Array  # bool []: a stop token has been generated


def denoise_block(params, cur, cache, policy_state, key, draws, *, config: SDARConfig, options: SDAROptions,
                  policy: AttentionPolicy = Dense()):
    """Denoises one block cur int32 [B, bl] against the cache until no mask is left, then commits it.

    Each forward's policy mode comes from `policy.block_mode(step, unmasked=..., commit=...)`, with
    `unmasked` the block tokens unmasked since the last forward whose mode was not SPARSE.
    `draws` counts the random draws so far (the key is folded with it). Returns
    (cur, cache, policy_state, draws).
    """
    o = options
    mask_id = config.mask_token_id
    schedule = transfer_counts(config.block_size, o.denoising_steps)

    def body(s: BlockCarry) -> BlockCarry:
        mask_index = s.cur == mask_id
        finished = ~jnp.any(mask_index)
        # the official loop runs denoising_steps + 1 forwards at most; the last one must commit
        commit = finished | (s.step >= o.denoising_steps)
        mode = policy.block_mode(s.step, unmasked=s.unmasked, commit=commit)
        logits, cache, policy_state = sdar_model.block_step(params, s.cur, s.cache, s.policy_state, mode,
                                                            config=config, policy=policy, commit=commit)
        u = jax.random.uniform(jax.random.fold_in(key, s.draws), s.cur.shape, jnp.float32)
        x0, x0_p = sample_tokens(logits, u, temperature=o.temperature, top_k=o.top_k, top_p=o.top_p)
        count = schedule[jnp.minimum(s.step, o.denoising_steps - 1)]
        transfer = transfer_mask(o.remasking, mask_index, x0_p, count, o.confidence_threshold) & ~commit
        unmasked = unmasked_since_refresh(s.unmasked, mode, jnp.sum(transfer, dtype=jnp.int32))
        return BlockCarry(cur=jnp.where(transfer, x0, s.cur), cache=cache, policy_state=policy_state,
                          draws=s.draws + (~commit).astype(jnp.int32), done=commit, step=s.step + 1,
                          unmasked=unmasked)

    start = BlockCarry(cur=cur, cache=cache, policy_state=policy_state, draws=draws, done=jnp.array(False),
                       step=0, unmasked=jnp.int32(0))
    s = jax.lax.while_loop(lambda s: ~s.done, body, start)
    return s.cur, s.cache, s.policy_state, s.draws


def generate_sdar(params, prompt_ids, seed, run_id=0, *, config: SDARConfig, options: SDAROptions,
                  policy: AttentionPolicy = Dense(), on_step=None, return_policy_state: bool = False):
    """The whole generation, traceable as one function.

    `on_step(run_id, block)` (static), if given, is called on the host after every decoded block.
    `policy` (static, Dense() by default) routes the block steps' attention through an attention
    policy; its per-layer state rides in the carry and its mode is chosen per forward by
    `policy.block_mode` (the prefill stays dense).
    Returns (x int32 [B, total], end int32 []): total = ceil((P + max_new_tokens) / bl) * bl; the
    blocks after the stop are left as masks, and `end` is the length of the decoded prefix. With
    `return_policy_state`, the final per-layer policy state comes third (for diagnostics).
    """
    check_policy(policy)
    o, bl = options, config.block_size
    b, p = prompt_ids.shape
    num_blocks = -(-(p + o.max_new_tokens) // bl)
    total = num_blocks * bl
    prefill_blocks = p // bl
    x = jnp.full((b, total), config.mask_token_id, jnp.int32).at[:, :p].set(prompt_ids.astype(jnp.int32))
    # a capacity in whole 128-key tiles lets the split-KV kernels read the cache without padding it
    cache = sdar_model.init_cache(config, b, -(-total // CACHE_TILE) * CACHE_TILE, params["embed"].dtype)
    if prefill_blocks:
        cache = sdar_model.prefill(params, x[:, : prefill_blocks * bl], cache, config=config)
    key = jax.random.key(seed)
    stop_ids = jnp.asarray(config.eos_token_ids, jnp.int32)

    def decode(carry: DecodeCarry, block) -> DecodeCarry:
        cur = jax.lax.dynamic_slice_in_dim(carry.x, block * bl, bl, axis=1)
        cur, cache, policy_state, draws = denoise_block(params, cur, carry.cache, carry.policy_state, key, carry.draws,
                                                        config=config, options=o, policy=policy)
        if on_step is not None:
            # a count needs no ordering, and an unordered callback adds no sync point per step
            jax.debug.callback(on_step, run_id, block, ordered=False)
        return carry.replace(x=jax.lax.dynamic_update_slice_in_dim(carry.x, cur, block * bl, axis=1), cache=cache,
                             policy_state=policy_state, draws=draws)

    def per_block(carry: DecodeCarry, block):
        carry = jax.lax.cond(carry.stopped, lambda carry, block: carry, decode, carry, block)
        generated = jnp.arange(total) >= p
        stopped = carry.stopped | jnp.any(jnp.isin(carry.x, stop_ids) & generated[None, :])
        return carry.replace(stopped=stopped), None

    carry = DecodeCarry(x=x, cache=cache, policy_state=sdar_model.init_policy_state(policy, config, b, total),
                        draws=jnp.int32(0), stopped=jnp.array(False))
    carry, _ = jax.lax.scan(per_block, carry, jnp.arange(prefill_blocks, num_blocks, dtype=jnp.int32))
    if return_policy_state:
        return carry.x, carry.cache.length, carry.policy_state
    return carry.x, carry.cache.length


STATIC = ("config", "options", "policy", "on_step", "return_policy_state")
generate_sdar_jit = jax.jit(generate_sdar, static_argnames=STATIC)


def trim(x, end: int, prompt_length: int, stop_ids) -> list:
    """Host-side: each row cut after its first stop token in the generated part (kept), else at `end`."""
    rows = []
    for row in x:
        row = row[:end]
        hits = [i for i in range(prompt_length, len(row)) if int(row[i]) in stop_ids]
        rows.append(row[: hits[0] + 1] if hits else row)
    return rows
