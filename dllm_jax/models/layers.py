"""Transformer pieces shared by the model families: pure functions for the math, one NNX module
holding the decoder layers' parameters stacked on a leading layer axis (run with `lax.scan`, so a
32-layer model compiles one layer body).

Parameter layout (the tree the checkpoint converter writes; L = layers, H/K = query/kv heads,
D = head_dim, d = hidden size, I = intermediate size):
  attn_norm [L, d]; q_proj [L, d, H, D]; k_proj, v_proj [L, d, K, D]; o_proj [L, H, D, d];
  q_norm, k_norm [L, D] (only with qk_norm); mlp_norm [L, d];
  gate_proj, up_proj [L, d, I]; down_proj [L, I, d].
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dllm_jax.attention.dense import matmul_precision


def rms_norm(x, weight, eps: float):
    """RMSNorm as HF `LlamaRMSNorm`: statistics in fp32, cast back to x's dtype, then × weight."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_tables(positions, head_dim: int, theta: float):
    """cos/sin tables [..., head_dim] in fp32 for half-rotation RoPE at integer `positions`."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin, *, in_fp32: bool):
    """Rotates x [B, L, H, D] by tables cos/sin [L, D] or [B, L, D] (NeoX/HF half rotation).

    in_fp32=True rotates in fp32 and casts back (LLaDA's rope_full_precision); False casts the
    tables to x's dtype first (HF Qwen3/Llama). Identical for fp32 inputs.
    """
    compute = jnp.float32 if in_fp32 else x.dtype
    xc = x.astype(compute)
    cos = cos.astype(compute)[..., None, :]
    sin = sin.astype(compute)[..., None, :]
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xc[..., half:], xc[..., :half]], axis=-1)
    return (xc * cos + rotated * sin).astype(x.dtype)


def attention_sublayer(p, x, cos, sin, attend, state, layer, config):
    """x + o_proj(attend(rope(q), rope(k), v)) of the pre-normed x; p holds one layer's params.

    `attend(q, k, v, state, layer) -> (out, state)` is the model's per-layer attention step: the
    attention policy's call on that layer (dllm_jax.attention.policy.attend_layer), plus any KV-cache
    write, with its state (policy state, cache) threaded through.
    """
    precision = matmul_precision(x.dtype)
    eps = config.rms_norm_eps
    h = rms_norm(x, p["attn_norm"], eps)
    q = jnp.einsum("bld,dhk->blhk", h, p["q_proj"], precision=precision)
    k = jnp.einsum("bld,dhk->blhk", h, p["k_proj"], precision=precision)
    v = jnp.einsum("bld,dhk->blhk", h, p["v_proj"], precision=precision)
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], eps)
        k = rms_norm(k, p["k_norm"], eps)
    q = apply_rope(q, cos, sin, in_fp32=config.rope_in_fp32)
    k = apply_rope(k, cos, sin, in_fp32=config.rope_in_fp32)
    with jax.named_scope("attention"):
        out, state = attend(q, k, v, state, layer)
    return x + jnp.einsum("blhk,hkd->bld", out, p["o_proj"], precision=precision), state


def mlp_sublayer(p, x, *, eps: float):
    """x + down(silu(gate(h)) * up(h)) with h = mlp_norm(x) (SwiGLU)."""
    precision = matmul_precision(x.dtype)
    h = rms_norm(x, p["mlp_norm"], eps)
    gate = jnp.matmul(h, p["gate_proj"], precision=precision)
    up = jnp.matmul(h, p["up_proj"], precision=precision)
    return x + jnp.matmul(jax.nn.silu(gate) * up, p["down_proj"], precision=precision)


@struct.dataclass
class LayerCarry:
    """The carry of the scan over decoder layers."""

    x: jax.Array  # [B, L, d] hidden states
    state: Any  # threaded through every layer's `attend` call


def decoder_stack(layers, x, cos, sin, attend, config, state=()):
    """Runs all decoder layers over x [B, L, d] with one `lax.scan` over the stacked params.

    Returns (x, state): `state` is threaded through every layer's `attend` call (the scan carry).
    """
    def layer(carry: LayerCarry, xs):
        p, index = xs
        h, state = attention_sublayer(p, carry.x, cos, sin, attend, carry.state, index, config)
        return LayerCarry(x=mlp_sublayer(p, h, eps=config.rms_norm_eps), state=state), None

    indices = jnp.arange(config.num_layers, dtype=jnp.int32)
    carry, _ = jax.lax.scan(layer, LayerCarry(x=x, state=state), (layers, indices))
    return carry.x, carry.state


def check_inputs(config, input_ids, attention_mask=None, *, name: str = "input_ids") -> None:
    """Host-side validation of token ids [B, L] (integers in [0, vocab_size)) and a mask of their shape
    (0/1, integer or bool) for any model family. Values are checked with numpy where the arrays are
    concrete; inside jit an out-of-range id would be clamped by the embedding gather, and a mask value
    2 or -1 would count as a real token."""
    if input_ids.ndim != 2:
        raise ValueError(f"{name} must be [batch, length], got shape {input_ids.shape}")
    if not np.issubdtype(input_ids.dtype, np.integer):
        raise ValueError(f"{name} must be integer token ids, got dtype {input_ids.dtype}")
    if not isinstance(input_ids, jax.core.Tracer):
        ids = np.asarray(input_ids)
        outside = (ids < 0) | (ids >= config.vocab_size)
        if outside.any():
            where = [tuple(int(i) for i in w) for w in np.argwhere(outside)[:5]]
            raise ValueError(f"{name}: token ids must lie in [0, {config.vocab_size}) (vocab_size), got "
                             f"{[int(ids[w]) for w in where]} at [batch, position] {where}")
    if attention_mask is None:
        return
    if tuple(np.shape(attention_mask)) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask shape {tuple(np.shape(attention_mask))} != {name} shape {input_ids.shape}")
    traced = isinstance(attention_mask, jax.core.Tracer)
    mask = attention_mask if traced else np.asarray(attention_mask)
    if mask.dtype != np.bool_ and not np.issubdtype(mask.dtype, np.integer):
        raise ValueError(f"attention_mask must hold integers or booleans (1 = token, 0 = padding), "
                         f"got dtype {mask.dtype}")
    if not traced:
        bad = np.unique(mask[(mask != 0) & (mask != 1)])
        if bad.size:
            raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (token), got values {bad.tolist()}")


def layer_param_shapes(config) -> dict[str, tuple[int, ...]]:
    """Shape of every stacked decoder-layer parameter for `config` (see the module docstring)."""
    n, d, i = config.num_layers, config.hidden_size, config.intermediate_size
    h, kv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    shapes = {
        "attn_norm": (n, d), "q_proj": (n, d, h, hd), "k_proj": (n, d, kv, hd),
        "v_proj": (n, d, kv, hd), "o_proj": (n, h, hd, d), "mlp_norm": (n, d),
        "gate_proj": (n, d, i), "up_proj": (n, d, i), "down_proj": (n, i, d),
    }
    if config.qk_norm:
        shapes |= {"q_norm": (n, hd), "k_norm": (n, hd)}
    return shapes


def lm_param_shapes(config) -> dict:
    """Shapes of a whole decoder LM's parameter tree (what `DecoderLM.params()` returns)."""
    shapes = {
        "embed": (config.vocab_size, config.hidden_size),
        "layers": layer_param_shapes(config),
        "final_norm": (config.hidden_size,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.hidden_size, config.vocab_size)
    return shapes


def lm_head(params, x, config):
    """float32 logits of the final hidden states x [B, L, d] (tied or untied head)."""
    x = rms_norm(x, params["final_norm"], config.rms_norm_eps)
    head = params["embed"].T if config.tie_word_embeddings else params["lm_head"]
    return jnp.matmul(x, head, precision=matmul_precision(x.dtype)).astype(jnp.float32)


class DecoderLayers(nnx.Module):
    """The stacked parameters of all decoder layers (one `nnx.Param` per weight, layer axis first)."""

    def __init__(self, config, *, dtype, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=0.02)
        for name, shape in layer_param_shapes(config).items():
            if name.endswith("norm"):
                value = jnp.ones(shape, dtype)
            else:
                value = init(rngs.params(), shape, dtype)
            setattr(self, name, nnx.Param(value))


class DecoderLM(nnx.Module):
    """Parameters of a decoder LM: embedding, stacked layers, final norm, LM head (absent if tied).

    `dtype` is both the parameter and the compute dtype. Subclasses add the forward passes.
    """

    def __init__(self, config, *, dtype=jnp.bfloat16, rngs: nnx.Rngs):
        self.config = config
        init = nnx.initializers.normal(stddev=0.02)
        self.embed = nnx.Param(init(rngs.params(), (config.vocab_size, config.hidden_size), dtype))
        self.layers = DecoderLayers(config, dtype=dtype, rngs=rngs)
        self.final_norm = nnx.Param(jnp.ones((config.hidden_size,), dtype))
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Param(init(rngs.params(), (config.hidden_size, config.vocab_size), dtype))

    @property
    def dtype(self):
        return self.embed[...].dtype

    def params(self) -> dict:
        """The parameter tree as a plain nested dict of arrays (the layout of `lm_param_shapes`)."""
        return nnx.to_pure_dict(nnx.state(self, nnx.Param))
