"""LLaDA in Flax NNX: a Llama-style transformer with fully bidirectional attention.

Numerics follow the original HF `modeling_llada.py`: RMSNorm statistics in fp32, RoPE applied in
fp32 (rope_full_precision), positions always 0..L-1 (left padding does not shift them), no logit
shift (logits[i] predicts token i), untied LM head unless the config ties it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.attention.dense import dense_attention
from dllm_jax.attention.policy import attend_layer, stacked_state
from dllm_jax.config import LLaDAConfig
from dllm_jax.models.layers import DecoderLM, decoder_stack, lm_head, lm_param_shapes, rope_tables, stateless

PADDING_MODES = ("ignore", "mask")
param_shapes = lm_param_shapes


def forward(params, input_ids, attention_mask=None, *, config: LLaDAConfig, padding: str = "ignore",
            attention_fn=dense_attention, logits_from: int = 0):
    """Full-sequence bidirectional forward.

    Args:
      params: the tree of `param_shapes(config)`; its dtype is the compute dtype.
      input_ids: int32 [B, L].
      attention_mask: optional [B, L], 1/True for real tokens, 0/False for padding.
      padding: "ignore" attends to pad tokens like the original HF file (the mask is unused);
        "mask" hides pad keys from every query (the ZHZisZZ/dllm fix).
      attention_fn: (q, k, v, *, key_mask) -> out, dense by default.
      logits_from: static; only positions >= it get logits (the LM head is the costliest matmul
        at long lengths, and generation only reads the answer region's logits).
    Returns:
      float32 logits [B, L - logits_from, vocab_size].
    """
    masks = padding_masks(attention_mask, padding)
    attend = stateless(functools.partial(attention_fn, **masks))
    logits, _ = logits_through(params, input_ids, attend, None, config=config, logits_from=logits_from)
    return logits


def forward_with_policy(params, input_ids, attention_mask, policy_state, step, *, config: LLaDAConfig, policy,
                        padding: str = "ignore", logits_from: int = 0):
    """`forward` with attention through `policy` (see dllm_jax.attention.policy).

    policy_state: the per-layer states stacked on a leading layer axis; step: the denoising step
    the policy's mode is chosen from. Returns (float32 logits, new policy_state).
    """
    masks = padding_masks(attention_mask, padding)
    mode = policy.mode(step)

    def attend(q, k, v, states, layer):
        return attend_layer(policy, mode, q, k, v, states, layer, **masks)

    return logits_through(params, input_ids, attend, policy_state, config=config, logits_from=logits_from)


def padding_masks(attention_mask, padding: str) -> dict:
    """The attention masks a padding mode asks for: a key mask for "mask", none for "ignore"."""
    if padding == "mask" and attention_mask is not None:
        return {"key_mask": attention_mask.astype(bool)}
    return {}


def logits_through(params, input_ids, attend, state, *, config: LLaDAConfig, logits_from: int):
    """Embedding, the layers with the `attend` hook (threading `state`), and the LM head from
    position `logits_from`: (float32 logits, state)."""
    x = params["embed"][input_ids]  # [B, L, d]
    cos, sin = rope_tables(jnp.arange(input_ids.shape[1]), config.head_dim, config.rope_theta)
    x, state = decoder_stack(params["layers"], x, cos, sin, attend, config, state)
    return lm_head(params, x[:, logits_from:], config), state


def init_policy_state(policy, config: LLaDAConfig, batch: int, length: int):
    """The policy's state for every layer (the full sequence attends to itself)."""
    return stacked_state(policy, config.num_layers, batch=batch, num_heads=config.num_heads,
                         num_kv_heads=config.num_kv_heads, q_len=length, kv_len=length, head_dim=config.head_dim)


_forward_jit = jax.jit(forward, static_argnames=("config", "padding", "attention_fn"))


class LLaDA(DecoderLM):
    """LLaDA masked-diffusion LM. `model(input_ids) -> float32 logits [B, L, V]`.

    `dtype` is both the parameter and the compute dtype (bfloat16 by default, float32 for
    numerics checks). Attention goes through `dllm_jax.attention.dense.dense_attention`
    (cuDNN flash attention on GPU for bf16, XLA otherwise) unless another `attention_fn` is given.
    """

    def __call__(self, input_ids, attention_mask=None, *, padding: str = "ignore",
                 attention_fn=dense_attention):
        """Logits [B, L, V] (float32) of int32 input_ids [B, L]; see `forward` for the arguments."""
        input_ids = jnp.asarray(input_ids)
        check_inputs(self.config, input_ids, attention_mask)
        if padding not in PADDING_MODES:
            raise ValueError(f"padding must be one of {PADDING_MODES}, got {padding!r}")
        return _forward_jit(self.params(), input_ids, attention_mask, config=self.config,
                            padding=padding, attention_fn=attention_fn)


def check_inputs(config, input_ids, attention_mask=None) -> None:
    """Host-side validation. Inside jit, out-of-range ids are clamped by the embedding gather."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, length], got shape {input_ids.shape}")
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise ValueError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
    if attention_mask is not None and tuple(np.shape(attention_mask)) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask shape {np.shape(attention_mask)} != input_ids shape {input_ids.shape}")
    if not isinstance(input_ids, jax.core.Tracer) and input_ids.size:
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {config.vocab_size}), got range [{low}, {high}]")
