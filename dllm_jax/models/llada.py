"""LLaDA in Flax NNX: a Llama-style transformer with fully bidirectional attention.

Numerics follow the original HF `modeling_llada.py`: RMSNorm statistics in fp32, RoPE applied in
fp32 (rope_full_precision), positions always 0..L-1 (left padding does not shift them), no logit
shift (logits[i] predicts token i), untied LM head unless the config ties it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flax import struct

from dllm_jax.attention.policy import AttentionPolicy, Dense, Mode, attend_layer, check_policy, stacked_state
from dllm_jax.config import LLaDAConfig
from dllm_jax.models.layers import DecoderLM, check_inputs, decoder_stack, lm_head, lm_param_shapes, rope_tables

PADDING_MODES = ("ignore", "mask")
param_shapes = lm_param_shapes


def forward(params, input_ids, attention_mask=None, policy_state=None, step=0, *, config: LLaDAConfig,
            policy: AttentionPolicy = Dense(), padding: str = "ignore", logits_from: int = 0):
    """Full-sequence bidirectional forward, attention through `policy` (dllm_jax.attention.policy).

    Args:
      params: the tree of `param_shapes(config)`; its dtype is the compute dtype.
      input_ids: int32 [B, L].
      attention_mask: optional [B, L], 1/True for real tokens, 0/False for padding.
      policy_state: the policy's per-layer states stacked on a leading layer axis; None starts from
        `init_policy_state` (nothing, for Dense).
      step: the denoising step (static or traced int32) the policy's mode is chosen from.
      policy: static; Dense() (`dense_attention`) by default.
      padding: "ignore" attends to pad tokens like the original HF file (the mask is unused);
        "mask" hides pad keys from every query (the ZHZisZZ/dllm fix).
      logits_from: static; only positions >= it get logits (the LM head is the costliest matmul
        at long lengths, and generation only reads the answer region's logits).
    Returns:
      (float32 logits [B, L - logits_from, vocab_size], new policy_state).
    """
    if policy_state is None:
        policy_state = init_policy_state(policy, config, *input_ids.shape)
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


@struct.dataclass
class KVCache:
    """Every layer's keys (after RoPE) and values over the whole sequence, from one full forward
    (Fast-dLLM's approximate cache: reused, stale, by a block's later steps)."""

    k: jax.Array  # [layers, B, L, Hkv, D]
    v: jax.Array  # [layers, B, L, Hkv, D]


def init_kv_cache(config: LLaDAConfig, batch: int, length: int, dtype) -> KVCache:
    """A zero KVCache of `length` positions, filled by `forward_caching`."""
    shape = (config.num_layers, batch, length, config.num_kv_heads, config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def forward_caching(params, input_ids, attention_mask=None, policy_state=(), mode=Mode.DENSE, *,
                    config: LLaDAConfig, policy: AttentionPolicy = Dense(), padding: str = "ignore",
                    logits_from: int = 0):
    """The full forward of `forward` with the policy in `mode` (traced int32 or a Mode), also
    returning the KVCache of every position: (float32 logits [B, L - logits_from, V], KVCache,
    new policy_state)."""
    masks = padding_masks(attention_mask, padding)
    cache = init_kv_cache(config, *input_ids.shape, params["embed"].dtype)

    def attend(q, k, v, carried, layer):
        cache, states = carried
        cache = KVCache(k=cache.k.at[layer].set(k), v=cache.v.at[layer].set(v))
        out, states = attend_layer(policy, mode, q, k, v, states, layer, **masks)
        return out, (cache, states)

    logits, (cache, policy_state) = logits_through(params, input_ids, attend, (cache, policy_state), config=config,
                                                   logits_from=logits_from)
    return logits, cache, policy_state


def forward_window(params, window_ids, start, cache: KVCache, attention_mask=None, policy_state=(),
                   mode=Mode.DENSE, *, config: LLaDAConfig, policy: AttentionPolicy = Dense(),
                   padding: str = "ignore", keep_below=None):
    """Float32 logits [B, W, V] of a window of the sequence against a KVCache of the whole sequence
    (Fast-dLLM). The cache is only read: the positions a window replaces are replaced again by every
    later window of the block, and a refresh rewrites them all, so storing them back (as the official
    dual cache does in place) would change no later result.

    window_ids int32 [B, W] sit at positions start .. start + W - 1 (traced start: RoPE angles and the
    cache slots follow it). Every query attends to all L cached positions, with the window's fresh
    keys and values in place of the cached ones at its positions, except positions below `keep_below`
    (traced int32 or None), which keep their cached keys and values: the prefix cache, whose window
    runs from the block to the end of the sequence while the cached prefix stays as the block's first
    step left it. attention_mask [B, L] (padding="mask") hides padding keys as `forward` does.
    Attention runs through `policy.attend_window` in `mode` with the (read-only) policy_state: a
    sparse method's pattern, built by a full forward, applied to the window's rows.
    """
    masks = padding_masks(attention_mask, padding)
    width = window_ids.shape[1]
    positions = start + jnp.arange(width)
    cos, sin = rope_tables(positions, config.head_dim, config.rope_theta)
    keep = None if keep_below is None else jnp.arange(cache.k.shape[2]) < keep_below

    def attend(q, k, v, cache: KVCache, layer):
        keys = jax.lax.dynamic_update_slice_in_dim(cache.k[layer], k.astype(cache.k.dtype), start, axis=1)
        values = jax.lax.dynamic_update_slice_in_dim(cache.v[layer], v.astype(cache.v.dtype), start, axis=1)
        if keep is not None:
            keys = jnp.where(keep[None, :, None, None], cache.k[layer], keys)
            values = jnp.where(keep[None, :, None, None], cache.v[layer], values)
        state = jax.tree.map(lambda s: s[layer], policy_state)
        return policy.attend_window(q, keys, values, state, mode, start=start, **masks), cache

    x = params["embed"][window_ids]
    x, _ = decoder_stack(params["layers"], x, cos, sin, attend, config, cache)
    return lm_head(params, x, config)


def init_policy_state(policy, config: LLaDAConfig, batch: int, length: int):
    """The policy's state for every layer (the full sequence attends to itself)."""
    return stacked_state(policy, config.num_layers, batch=batch, num_heads=config.num_heads,
                         num_kv_heads=config.num_kv_heads, q_len=length, kv_len=length, head_dim=config.head_dim)


@functools.partial(jax.jit, static_argnames=("config", "padding", "policy"))
def _logits_jit(params, input_ids, attention_mask, *, config: LLaDAConfig, padding: str, policy: AttentionPolicy):
    return forward(params, input_ids, attention_mask, config=config, padding=padding, policy=policy)[0]


class LLaDA(DecoderLM):
    """LLaDA masked-diffusion LM. `model(input_ids) -> float32 logits [B, L, V]`.

    `dtype` is both the parameter and the compute dtype (bfloat16 by default, float32 for
    numerics checks). Attention goes through `policy`: `Dense()` by default, i.e.
    `dllm_jax.attention.dense.dense_attention` (cuDNN flash attention on GPU for bf16, XLA otherwise).
    """

    def __call__(self, input_ids, attention_mask=None, *, padding: str = "ignore",
                 policy: AttentionPolicy = Dense()):
        """Logits [B, L, V] (float32) of int32 input_ids [B, L]: one forward of `policy` from its
        initial state at step 0 (see `forward`)."""
        input_ids = jnp.asarray(input_ids)
        check_inputs(self.config, input_ids, attention_mask)
        if padding not in PADDING_MODES:
            raise ValueError(f"padding must be one of {PADDING_MODES}, got {padding!r}")
        check_policy(policy)
        return _logits_jit(self.params(), input_ids, attention_mask, config=self.config, padding=padding,
                           policy=policy)
