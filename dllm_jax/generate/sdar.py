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

import jax
import jax.numpy as jnp

from dllm_jax.attention.policy import block_mode, unmasked_since_refresh
from dllm_jax.config import SDARConfig
from dllm_jax.generate.llada import commit_top
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
        if self.max_new_tokens <= 0 or self.denoising_steps <= 0:
            raise ValueError(f"max_new_tokens and denoising_steps must be positive, got "
                             f"{self.max_new_tokens}, {self.denoising_steps}")
        if self.remasking not in REMASKING:
            raise ValueError(f"remasking must be one of {REMASKING}, got {self.remasking!r}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be > 0 (the official sampler divides by it), got {self.temperature}")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need top_k >= 0 and 0 < top_p <= 1, got {self.top_k}, {self.top_p}")


def block_schedule(block_length: int, steps: int):
    """n[j] = block_length // steps, plus one on the first block_length % steps steps."""
    return block_length // steps + (jnp.arange(steps) < block_length % steps).astype(jnp.int32)


def sample(logits, u, *, temperature: float, top_k: int, top_p: float):
    """(tokens, probabilities of the drawn tokens after filtering) for logits [..., V], u [...] in [0, 1)."""
    if temperature != 1.0:
        logits = logits / temperature
    if top_k > 0:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1, stable=True)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        remove = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1) > top_p
        remove = jnp.concatenate([jnp.zeros_like(remove[..., :1]), remove[..., :-1]], axis=-1)
        removed = jnp.take_along_axis(remove, jnp.argsort(order, axis=-1), axis=-1)  # back to vocab order
        logits = jnp.where(removed, -jnp.inf, logits)
    probs = jax.nn.softmax(logits, axis=-1)
    cdf = jnp.cumsum(probs, axis=-1)
    tokens = jnp.argmax(cdf >= u[..., None] * cdf[..., -1:], axis=-1)
    return tokens, jnp.take_along_axis(probs, tokens[..., None], axis=-1)[..., 0]


def transfer_mask(strategy: str, mask_index, x0_p, count, threshold: float):
    """bool [B, n]: the positions a step commits."""
    if strategy == "sequential":
        n = mask_index.shape[1]
        first = jnp.argmax(mask_index, axis=1)[:, None]
        pos = jnp.arange(n)[None, :]
        return (pos >= first) & (pos < first + count)
    confidence = jnp.where(mask_index, x0_p, -jnp.inf)
    top = commit_top(confidence, jnp.broadcast_to(count, confidence.shape[:1]))
    if strategy == "low_confidence_static":
        return top
    high = confidence > threshold
    return jnp.where(jnp.sum(high, axis=1, keepdims=True) >= count, high, top)


def denoise_block(params, cur, cache, policy_state, key, draws, *, config: SDARConfig, options: SDAROptions,
                  policy=None, attention_fn=sdar_model.dense_attention):
    """Denoises one block cur int32 [B, bl] against the cache until no mask is left, then commits it.

    Each forward's policy mode comes from `block_mode(policy, step, unmasked=..., commit=...)`, with
    `unmasked` the block tokens unmasked since the last forward whose mode was not SPARSE.
    `draws` counts the random draws so far (the key is folded with it). Returns
    (cur, cache, policy_state, draws).
    """
    o = options
    mask_id = config.mask_token_id
    schedule = block_schedule(config.block_size, o.denoising_steps)

    def body(s):
        cur, cache, policy_state, draws, _, step, unmasked = s
        mask_index = cur == mask_id
        finished = ~jnp.any(mask_index)
        # the official loop runs denoising_steps + 1 forwards at most; the last one must commit
        commit = finished | (step >= o.denoising_steps)
        mode = None if policy is None else block_mode(policy, step, unmasked=unmasked, commit=commit)
        logits, cache, policy_state = sdar_model.block_step_with_policy(
            params, cur, cache, policy_state, mode, config=config, policy=policy, commit=commit,
            attention_fn=attention_fn)
        u = jax.random.uniform(jax.random.fold_in(key, draws), cur.shape, jnp.float32)
        x0, x0_p = sample(logits, u, temperature=o.temperature, top_k=o.top_k, top_p=o.top_p)
        count = schedule[jnp.minimum(step, o.denoising_steps - 1)]
        transfer = transfer_mask(o.remasking, mask_index, x0_p, count, o.confidence_threshold) & ~commit
        if mode is not None:
            unmasked = unmasked_since_refresh(unmasked, mode, jnp.sum(transfer, dtype=jnp.int32))
        cur = jnp.where(transfer, x0, cur)
        return cur, cache, policy_state, draws + (~commit).astype(jnp.int32), commit, step + 1, unmasked

    cur, cache, policy_state, draws, _, _, _ = jax.lax.while_loop(
        lambda s: ~s[4], body, (cur, cache, policy_state, draws, jnp.array(False), 0, jnp.int32(0)))
    return cur, cache, policy_state, draws


def generate_sdar(params, prompt_ids, seed, run_id=0, *, config: SDARConfig, options: SDAROptions,
                  policy=None, attention_fn=sdar_model.dense_attention, on_step=None,
                  return_policy_state: bool = False):
    """The whole generation, traceable as one function.

    `on_step(run_id, block)` (static), if given, is called on the host after every decoded block.
    `policy` (static, optional) routes the block steps' attention through an attention policy; its
    per-layer state rides in the carry and its mode is chosen per forward by `block_mode` (the
    prefill stays dense).
    Returns (x int32 [B, total], end int32 []): total = ceil((P + max_new_tokens) / bl) * bl; the
    blocks after the stop are left as masks, and `end` is the length of the decoded prefix. With
    `return_policy_state`, the final per-layer policy state comes third (for diagnostics).
    """
    o, bl = options, config.block_size
    b, p = prompt_ids.shape
    num_blocks = -(-(p + o.max_new_tokens) // bl)
    total = num_blocks * bl
    prefill_blocks = p // bl
    x = jnp.full((b, total), config.mask_token_id, jnp.int32).at[:, :p].set(prompt_ids.astype(jnp.int32))
    # a capacity in whole 128-key tiles lets the split-KV kernels read the cache without padding it
    cache = sdar_model.init_cache(config, b, -(-total // CACHE_TILE) * CACHE_TILE, params["embed"].dtype)
    if prefill_blocks:
        cache = sdar_model.prefill(params, x[:, : prefill_blocks * bl], cache, config=config,
                                   attention_fn=attention_fn)
    key = jax.random.key(seed)
    stop_ids = jnp.asarray(config.eos_token_ids, jnp.int32)

    def decode(state):
        x, cache, policy_state, draws, block = state
        cur = jax.lax.dynamic_slice_in_dim(x, block * bl, bl, axis=1)
        cur, cache, policy_state, draws = denoise_block(params, cur, cache, policy_state, key, draws, config=config,
                                                        options=o, policy=policy, attention_fn=attention_fn)
        if on_step is not None:
            # a count needs no ordering, and an unordered callback adds no sync point per step
            jax.debug.callback(on_step, run_id, block, ordered=False)
        return jax.lax.dynamic_update_slice_in_dim(x, cur, block * bl, axis=1), cache, policy_state, draws

    def per_block(carry, block):
        x, cache, policy_state, draws, stopped = carry
        x, cache, policy_state, draws = jax.lax.cond(stopped, lambda s: s[:4], decode,
                                                     (x, cache, policy_state, draws, block))
        generated = jnp.arange(total) >= p
        stopped = stopped | jnp.any(jnp.isin(x, stop_ids) & generated[None, :])
        return (x, cache, policy_state, draws, stopped), None

    policy_state = () if policy is None else sdar_model.init_policy_state(policy, config, b, total)
    carry = (x, cache, policy_state, jnp.int32(0), jnp.array(False))
    (x, cache, policy_state, _, _), _ = jax.lax.scan(per_block, carry,
                                                     jnp.arange(prefill_blocks, num_blocks, dtype=jnp.int32))
    return (x, cache.length, policy_state) if return_policy_state else (x, cache.length)


STATIC = ("config", "options", "policy", "attention_fn", "on_step", "return_policy_state")
generate_sdar_jit = jax.jit(generate_sdar, static_argnames=STATIC)


def trim(x, end: int, prompt_length: int, stop_ids) -> list:
    """Host-side: each row cut after its first stop token in the generated part (kept), else at `end`."""
    rows = []
    for row in x:
        row = row[:end]
        hits = [i for i in range(prompt_length, len(row)) if int(row[i]) in stop_ids]
        rows.append(row[: hits[0] + 1] if hits else row)
    return rows
