"""LLaDA masked-diffusion generation as one compiled loop (the official `generate()` of ML-GSAI/LLaDA).

The answer region [P, P + gen_length) starts fully masked and is filled block by block (semi-
autoregressive); inside a block, each of `steps / num_blocks` steps runs the whole sequence through
the model, predicts every masked position, and commits the most confident predictions (or random
ones) following the per-block transfer schedule. All blocks x steps run in one `lax.scan`.

Random numbers (reproducible from `seed`): step t (0-based, over all blocks) draws its Gumbel
uniforms as `uniform(fold_in(fold_in(key(seed), 0), t), [B, L, V])` and its random-remasking
confidences as `uniform(fold_in(fold_in(key(seed), 1), t), [B, L])`, both float32 in [0, 1).
The official code draws the Gumbel noise in float64; JAX runs with 32-bit floats unless x64 is
enabled globally, so the noise here is float32 and the sampled token can differ from a float64 draw
only where two candidates' perturbed scores agree to ~1e-7 relative.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.config import LLaDAConfig
from dllm_jax.models import llada as llada_model

REMASKING = ("low_confidence", "random")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LLaDAOptions:
    """Static options of LLaDA generation (a change recompiles); see `generate_llada`."""

    gen_length: int = 128
    steps: int = 128
    block_length: int = 128
    temperature: float = 0.0
    cfg_scale: float = 0.0
    remasking: str = "low_confidence"
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    padding: str = "ignore"

    def __post_init__(self):
        for name in ("gen_length", "steps", "block_length"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.gen_length % self.block_length:
            raise ValueError(f"gen_length={self.gen_length} must be a multiple of block_length={self.block_length}"
                             + (" (block_length defaults to 128, as in the official generate; pass block_length="
                                "gen_length for a single block)" if self.block_length == 128 else ""))
        if self.steps % self.num_blocks:
            raise ValueError(f"steps={self.steps} must be a multiple of the number of blocks "
                             f"(gen_length / block_length = {self.num_blocks})")
        if self.remasking not in REMASKING:
            raise ValueError(f"remasking must be one of {REMASKING}, got {self.remasking!r}")
        if self.padding not in llada_model.PADDING_MODES:
            raise ValueError(f"padding must be one of {llada_model.PADDING_MODES}, got {self.padding!r}")
        if self.temperature < 0 or self.cfg_scale < 0:
            raise ValueError(f"temperature and cfg_scale must be >= 0, got {self.temperature}, {self.cfg_scale}")

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    @property
    def steps_per_block(self) -> int:
        return self.steps // self.num_blocks


def transfer_counts(masked, steps: int):
    """Tokens to commit at each of `steps` steps for rows with `masked` [B] masks: M//S, plus one
    on the first M%S steps (the official get_num_transfer_tokens). Returns int32 [B, steps]."""
    base = masked // steps
    extra = masked % steps
    return base[:, None] + (jnp.arange(steps)[None, :] < extra[:, None]).astype(jnp.int32)


def gumbel_argmax(logits, temperature: float, key, total: int):
    """argmax of exp(l) / (-log u)^T, computed as argmax(l - T log(-log u)) (same argmax, no overflow).

    logits [B, n, V] are the last n of `total` positions; the uniforms are drawn for all `total`
    positions (so the random stream does not depend on which positions get logits)."""
    if temperature == 0:
        return jnp.argmax(logits, axis=-1)
    b, n, v = logits.shape
    u = jax.random.uniform(key, (b, total, v), jnp.float32)[:, total - n:]
    return jnp.argmax(logits - temperature * jnp.log(-jnp.log(u)), axis=-1)


def commit_top(confidence, count):
    """bool [B, L]: in each row, the `count[b]` positions of highest confidence (ties: lowest index)."""
    order = jnp.argsort(-confidence, axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)
    return rank < count[:, None]


def generate_llada(params, prompt_ids, attention_mask, seed, run_id=0, *, config: LLaDAConfig, options: LLaDAOptions,
                   prompt_has_masks: bool = False, policy=None, attention_fn=llada_model.dense_attention,
                   on_step=None, return_policy_state: bool = False):
    """The whole generation, traceable as one function. Returns int32 [B, P + gen_length].

    prompt_ids int32 [B, P] (left-padded if rows differ); attention_mask [B, P] or None.
    `on_step(run_id, step)` (static), if given, is called on the host after every step.
    Unless `prompt_has_masks` (static), logits are computed for the answer region only: no other
    position is masked, so no other prediction can be committed. `policy` (static, optional) routes
    every attention call through an attention policy whose per-layer state rides in the loop carry;
    without one, attention is `attention_fn` (dense). `return_policy_state` (static) also returns the
    policy's final per-layer state (for diagnostics: dllm_jax.analysis).
    """
    b, p = prompt_ids.shape
    o = options
    mask_id = config.mask_token_id
    total = p + o.gen_length
    x = jnp.concatenate([prompt_ids.astype(jnp.int32), jnp.full((b, o.gen_length), mask_id, jnp.int32)], axis=1)
    prompt_index = x != mask_id
    if attention_mask is not None:
        attention_mask = jnp.concatenate([attention_mask.astype(jnp.int32), jnp.ones((b, o.gen_length), jnp.int32)], 1)
    positions = jnp.arange(total)
    key = jax.random.key(seed)
    gumbel_key, random_key = jax.random.fold_in(key, 0), jax.random.fold_in(key, 1)
    logits_from = 0 if prompt_has_masks else p
    model = functools.partial(llada_model.forward, config=config, padding=o.padding, attention_fn=attention_fn,
                              logits_from=logits_from)
    positions = positions[logits_from:]

    rows = 2 * b if o.cfg_scale > 0 else b
    if policy is not None:
        model_with_policy = functools.partial(llada_model.forward_with_policy, config=config, policy=policy,
                                              padding=o.padding, logits_from=logits_from)

    def run_model(x, mask, policy_state, t):
        if policy is None:
            return model(params, x, mask), policy_state
        return model_with_policy(params, x, mask, policy_state, t)

    def logits_of(x, policy_state, t):
        if o.cfg_scale > 0:
            unconditional = jnp.where(prompt_index, mask_id, x)
            mask = None if attention_mask is None else jnp.concatenate([attention_mask, attention_mask])
            both, policy_state = run_model(jnp.concatenate([x, unconditional]), mask, policy_state, t)
            cond, uncond = both[:b], both[b:]
            return uncond + (o.cfg_scale + 1) * (cond - uncond), policy_state
        return run_model(x, attention_mask, policy_state, t)

    def step(carry, t):
        x, counts, policy_state = carry
        block, i = t // o.steps_per_block, t % o.steps_per_block
        block_end = p + (block + 1) * o.block_length
        in_block = (positions >= block_end - o.block_length) & (positions < block_end)
        mask_index = x[:, logits_from:] == mask_id
        # the schedule of a block comes from its mask count at the block's first step
        counts = jnp.where(i == 0, transfer_counts(jnp.sum(mask_index & in_block, axis=1), o.steps_per_block), counts)
        logits, policy_state = logits_of(x, policy_state, t)
        if o.logits_eos_inf:
            logits = logits.at[..., config.eos_token_id].set(-jnp.inf)
        x0 = gumbel_argmax(logits, o.temperature, jax.random.fold_in(gumbel_key, t), total)
        if o.confidence_eos_eot_inf:
            # generate.py: `logits_with_noise[..., EOS] = logits[..., EoT] = -inf`. The confidence
            # softmax reads `logits`, so EoT confidence becomes 0; at T=0 add_gumbel_noise returns
            # `logits` itself, the two names alias, and EOS confidence becomes 0 as well.
            logits = logits.at[..., config.eot_token_id].set(-jnp.inf)
            if o.temperature == 0:
                logits = logits.at[..., config.eos_token_id].set(-jnp.inf)
        if o.remasking == "low_confidence":
            probs = jax.nn.softmax(logits, axis=-1)
            x0_p = jnp.take_along_axis(probs, x0[..., None], axis=-1)[..., 0]
        else:
            x0_p = jax.random.uniform(jax.random.fold_in(random_key, t), (b, total), jnp.float32)[:, logits_from:]
        x0_p = jnp.where(positions[None, :] >= block_end, -jnp.inf, x0_p)
        x0 = jnp.where(mask_index, x0, x[:, logits_from:])
        confidence = jnp.where(mask_index, x0_p, -jnp.inf)
        transfer = commit_top(confidence, counts[:, i])
        x = x.at[:, logits_from:].set(jnp.where(transfer, x0, x[:, logits_from:]))
        if on_step is not None:
            # a count needs no ordering, and an unordered callback adds no sync point per step
            jax.debug.callback(on_step, run_id, t, ordered=False)
        return (x, counts, policy_state), None

    counts = jnp.zeros((b, o.steps_per_block), jnp.int32)
    policy_state = () if policy is None else llada_model.init_policy_state(policy, config, rows, total)
    (x, _, policy_state), _ = jax.lax.scan(step, (x, counts, policy_state), jnp.arange(o.steps, dtype=jnp.int32))
    return (x, policy_state) if return_policy_state else x


STATIC = ("config", "options", "prompt_has_masks", "policy", "attention_fn", "on_step", "return_policy_state")
generate_llada_jit = jax.jit(generate_llada, static_argnames=STATIC)


def check_prompt(config: LLaDAConfig, prompt_ids: np.ndarray, attention_mask) -> None:
    if prompt_ids.ndim != 2 or prompt_ids.shape[1] == 0:
        raise ValueError(f"prompt_ids must be [batch, length>0], got shape {prompt_ids.shape}")
    llada_model.check_inputs(config, jnp.asarray(prompt_ids), attention_mask)
