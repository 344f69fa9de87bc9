"""Dream (Dream-v0-Instruct-7B / -Base-7B) in Flax NNX: the Qwen2.5 architecture with fully
bidirectional attention.

Numerics follow the official `modeling_dream.py` (HF Qwen2 with `is_causal = False`): q/k/v
projections with biases (the fused `qkv_bias` of `dllm_jax.models.layers`), no q/k RMSNorm, RMSNorm
statistics in fp32, RoPE tables cast to the activation dtype before rotating, untied LM head unless
the config ties it. `forward` returns logits[i] at position i, unshifted: Dream reads position i's
token from logits[i - 1], a shift that belongs to generation (`dllm_jax.generate.dream`).

Padding follows the official sampler: with an attention mask, position ids are cumsum(mask) - 1
(padding at 1) and no query sees a padding key. The official code also hides every key from a
padding query (a pairwise mask); that changes only the padding positions' own outputs, which no
other position reads (their keys are hidden), so the logits of real tokens are the same.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dllm_jax.attention.policy import AttentionPolicy, Dense, attend_layer, check_policy
from dllm_jax.config import DreamConfig
from dllm_jax.models.layers import DecoderLM, check_inputs, decoder_stack, lm_head, lm_param_shapes, rope_tables
from dllm_jax.models.llada import init_policy_state

param_shapes = lm_param_shapes


def position_ids(attention_mask, length: int):
    """int32 positions: [L] 0..L-1 without a mask; [B, L] cumsum(mask) - 1 with one, padding at 1
    (the official sampler's `tok_idx`)."""
    if attention_mask is None:
        return jnp.arange(length, dtype=jnp.int32)
    mask = attention_mask.astype(jnp.int32)
    return jnp.where(mask == 0, 1, jnp.cumsum(mask, axis=-1) - 1)


def forward(params, input_ids, attention_mask=None, policy_state=None, step=0, *, config: DreamConfig,
            policy: AttentionPolicy = Dense(), logits_from: int = 0):
    """Full-sequence bidirectional forward, attention through `policy` (dllm_jax.attention.policy).

    Args:
      params: the tree of `param_shapes(config)`; its dtype is the compute dtype.
      input_ids: int32 [B, L].
      attention_mask: optional [B, L], 1/True for real tokens, 0/False for padding (see the module
        docstring: positions from its cumulative sum, padding keys hidden).
      policy_state: the policy's per-layer states stacked on a leading layer axis; None starts from
        `init_policy_state`.
      step: the denoising step (static or traced int32) the policy's mode is chosen from.
      policy: static; Dense() by default.
      logits_from: static; only positions >= it get logits.
    Returns:
      (float32 logits [B, L - logits_from, vocab_size], unshifted, new policy_state).
    """
    b, n = input_ids.shape
    if policy_state is None:
        policy_state = init_policy_state(policy, config, b, n)
    masks = {} if attention_mask is None else {"key_mask": attention_mask.astype(bool)}
    mode = policy.mode(step)

    def attend(q, k, v, states, layer):
        return attend_layer(policy, mode, q, k, v, states, layer, **masks)

    x = params["embed"][input_ids]  # [B, L, d]
    cos, sin = rope_tables(position_ids(attention_mask, n), config.head_dim, config.rope_theta)
    x, policy_state = decoder_stack(params["layers"], x, cos, sin, attend, config, policy_state)
    return lm_head(params, x[:, logits_from:], config), policy_state


@functools.partial(jax.jit, static_argnames=("config", "policy"))
def _logits_jit(params, input_ids, attention_mask, *, config: DreamConfig, policy: AttentionPolicy):
    return forward(params, input_ids, attention_mask, config=config, policy=policy)[0]


class Dream(DecoderLM):
    """Dream masked-diffusion LM. `model(input_ids) -> float32 logits [B, L, V]` (unshifted).

    `dtype` is both the parameter and the compute dtype (bfloat16 by default, float32 for numerics
    checks). Attention goes through `policy`: `Dense()` by default.
    """

    def __call__(self, input_ids, attention_mask=None, *, policy: AttentionPolicy = Dense()):
        """Logits [B, L, V] (float32) of int32 input_ids [B, L]: one forward of `policy` from its
        initial state at step 0 (see `forward`)."""
        input_ids = jnp.asarray(input_ids)
        check_inputs(self.config, input_ids, attention_mask)
        check_policy(policy)
        return _logits_jit(self.params(), input_ids, attention_mask, config=self.config, policy=policy)
