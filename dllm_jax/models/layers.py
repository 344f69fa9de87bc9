"""Transformer pieces shared by the model families: pure functions for the math, and the NNX module
holding a decoder LM's parameters in the layout inference runs on.

Two parameter layouts (L = layers, H/K = query/kv heads, D = head_dim, d = hidden size,
I = intermediate size):
  * checkpoint layout (what the converter writes, `lm_param_shapes`): layers stacked on a leading
    axis, one tensor per projection: attn_norm [L, d]; q_proj [L, d, H, D]; k_proj, v_proj
    [L, d, K, D]; o_proj [L, H, D, d]; q_norm, k_norm [L, D] (only with qk_norm); q_bias [L, H, D],
    k_bias, v_bias [L, K, D] (only with qkv_bias: Qwen2 / Dream); mlp_norm [L, d];
    gate_proj, up_proj [L, d, I]; down_proj [L, I, d].
  * inference layout (`prepare_params`, done once at load): the projections a sublayer applies to
    the same input fused into one matrix, qkv_proj [d, (H + 2K) * D] and gate_up_proj [d, 2I]
    (one GEMM reads each weight once instead of three or two launches), o_proj [H * D, d]. The fused
    columns are grouped so that any contiguous split of them is a Megatron tensor-parallel shard:
    qkv_proj per KV head k, [its G = H / K query heads k*G .. k*G + G - 1, its key, its value] (each
    D wide; the optional qkv_bias [(H + 2K) * D] grouped the same way), and gate_up_proj interleaved, column 2j gate j and 2j + 1 up j (`dllm_jax.sharding`
    splits the columns over "tp"). Then
    either one dict per layer in a tuple ("unrolled", the default: the layers are traced one after
    the other under jit, every GEMM reads its weights in place) or the same names stacked on a
    leading layer axis ("scan": one `lax.scan` body, compiles faster, but XLA copies each layer's
    slice out of the stacked arrays before its GEMMs: the weights are read about twice).
`decoder_stack` takes either inference layout, and the checkpoint layout too (then fused inside
the traced function at every call: what tests of the pure functions use).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dllm_jax.attention.dense import matmul_precision
from dllm_jax.quantize import (is_scale, linear, quantize_weight, quantized_inference_shapes, scale_name,
                               transpose_quantized)


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


EXECUTIONS = ("unrolled", "scan")

# quantized linear layers (dllm_jax.quantize): in the checkpoint layout, each with the axes its GEMM
# contracts (a stacked layer weight's count its layer axis), as `Family.quantized` tables are; in the inference
# layout, the layers' fused names
QUANTIZED = {"layers": {"q_proj": (1,), "k_proj": (1,), "v_proj": (1,), "o_proj": (1, 2), "gate_proj": (1,),
                        "up_proj": (1,), "down_proj": (1,)},
             "lm_head": (0,)}  # an untied head (a tied one is the embedding table, gathered: kept as it is)
QUANTIZED_INFERENCE = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def rotate(x, cos, sin, config):
    """RoPE (`apply_rope`) on the first config.rotary_dim dimensions of each head of x [B, L, H, D]; the
    rest pass through (LLaDA2's partial rotary; the other families rotate all of them)."""
    r = config.rotary_dim
    if r == x.shape[-1]:
        return apply_rope(x, cos, sin, in_fp32=config.rope_in_fp32)
    rotated = apply_rope(x[..., :r], cos, sin, in_fp32=config.rope_in_fp32)
    return jnp.concatenate([rotated, x[..., r:]], axis=-1)


def attention_sublayer(p, x, cos, sin, attend, state, layer, config):
    """x + o_proj(attend(rope(q), rope(k), v)) of the pre-normed x; p holds one layer's inference
    weights (fused qkv_proj). The config's attention variants: q/k/v biases (`qkv_bias`: Dream, LLaDA2's
    use_qkv_bias), per-head q/k RMSNorm before RoPE (`qk_norm`), partial rotary (`rotary_dim`), an output
    bias (`o_bias`: LLaDA2's use_bias).

    `attend(q, k, v, state, layer) -> (out, state)` is the model's per-layer attention step: the
    attention policy's call on that layer (dllm_jax.attention.policy.attend_layer), plus any KV-cache
    write, with its state (policy state, cache) threaded through. `layer` is a Python int when the
    layers are unrolled, an int32 tracer under `lax.scan`.
    """
    precision = matmul_precision(x.dtype)
    eps = config.rms_norm_eps
    b, n, _ = x.shape
    h, kv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    qkv = linear(rms_norm(x, p["attn_norm"], eps), p, "qkv_proj", precision=precision)
    if config.qkv_bias:
        qkv = qkv + p["qkv_bias"]  # HF Linear: the bias added to the projection, before RoPE
    qkv = qkv.reshape(b, n, kv, h // kv + 2, hd)  # per KV head: its query heads, its key, its value
    q, k, v = qkv[:, :, :, :-2].reshape(b, n, h, hd), qkv[:, :, :, -2], qkv[:, :, :, -1]
    if config.qk_norm:
        q = rms_norm(q, p["q_norm"], eps)
        k = rms_norm(k, p["k_norm"], eps)
    q, k = rotate(q, cos, sin, config), rotate(k, cos, sin, config)
    with jax.named_scope("attention"):
        out, state = attend(q, k, v, state, layer)
    out = linear(out.reshape(b, n, h * hd), p, "o_proj", precision=precision)
    if config.o_bias:
        out = out + p["o_bias"]
    return x + out, state


def interleave(gate, up):
    """[..., n] gate and up -> [..., 2n] with column 2j gate j and 2j + 1 up j (the layout `swiglu_gate` reads)."""
    return jnp.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)


def swiglu_gate(both):
    """silu(gate) * up of one GEMM's output with interleaved columns [..., 2n] (module docstring)."""
    return jax.nn.silu(both[..., 0::2]) * both[..., 1::2]


def mlp_sublayer(p, x, *, eps: float):
    """x + down(silu(gate(h)) * up(h)) with h = mlp_norm(x) (SwiGLU; gate and up as one GEMM)."""
    precision = matmul_precision(x.dtype)
    both = linear(rms_norm(x, p["mlp_norm"], eps), p, "gate_up_proj", precision=precision)
    return x + linear(swiglu_gate(both), p, "down_proj", precision=precision)


@struct.dataclass
class LayerCarry:
    """The carry of the scan over decoder layers."""

    x: jax.Array  # [B, L, d] hidden states
    state: Any  # threaded through every layer's `attend` call


def decoder_stack(layers, x, cos, sin, attend, config, state=()):
    """Runs all decoder layers over x [B, L, d]; returns (x, state), `state` threaded through every
    layer's `attend` call.

    `layers` in the unrolled inference layout (a tuple of per-layer dicts) runs the layers one after
    the other with static layer indices; the scan layout (stacked) runs one `lax.scan`; the
    checkpoint layout is fused first (see the module docstring).
    """
    layers = inference_layers(layers, config, execution=None)
    if isinstance(layers, tuple):
        for index, p in enumerate(layers):
            x, state = attention_sublayer(p, x, cos, sin, attend, state, index, config)
            x = mlp_sublayer(p, x, eps=config.rms_norm_eps)
        return x, state

    def layer(carry: LayerCarry, xs):
        p, index = xs
        h, state = attention_sublayer(p, carry.x, cos, sin, attend, carry.state, index, config)
        return LayerCarry(x=mlp_sublayer(p, h, eps=config.rms_norm_eps), state=state), None

    indices = jnp.arange(config.num_layers, dtype=jnp.int32)
    carry, _ = jax.lax.scan(layer, LayerCarry(x=x, state=state), (layers, indices))
    return carry.x, carry.state


def check_execution(execution: str) -> None:
    if execution not in EXECUTIONS:
        raise ValueError(f"execution={execution!r} is not one of {EXECUTIONS} (unrolled: fastest, the default; "
                         "scan: faster to compile)")


def fuse_layers(stacked: dict, config) -> dict:
    """Checkpoint layout (stacked) -> the scan inference layout. Pops each source tensor from
    `stacked` as soon as its fused form exists, so that on device the peak is the model plus one
    group of projections, not two models. Quantized weights' per-channel scales (`<name>_scale`, over a
    weight's output axes) are fused as their columns are."""
    n, d, kv, hd = config.num_layers, config.hidden_size, config.num_kv_heads, config.head_dim
    fused = {name: stacked.pop(name) for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm") if name in stacked}
    # [L, d, K, G + 2, D]: each KV head's query heads, key and value side by side (module docstring)
    grouped = [stacked.pop(name).reshape(n, d, kv, -1, hd) for name in ("q_proj", "k_proj", "v_proj")]
    fused["qkv_proj"] = jnp.concatenate(grouped, axis=3).reshape(n, d, -1)
    column_groups = [("qkv_bias", ("q_bias", "k_bias", "v_bias"))] if config.qkv_bias else []
    if config.quantize:
        column_groups.append(("qkv_proj_scale", tuple(scale_name(p) for p in ("q_proj", "k_proj", "v_proj"))))
    for target, names in column_groups:  # [L, H | K, D] each: the columns of qkv_proj
        columns = [stacked.pop(name).reshape(n, kv, -1, hd) for name in names]
        fused[target] = jnp.concatenate(columns, axis=2).reshape(n, -1)
    fused["o_proj"] = stacked.pop("o_proj").reshape(n, -1, d)
    gate_up = [stacked.pop("gate_proj"), stacked.pop("up_proj")]
    fused["gate_up_proj"] = jnp.stack(gate_up, axis=-1).reshape(n, d, -1)
    fused["down_proj"] = stacked.pop("down_proj")
    if config.quantize:
        gate_up = [stacked.pop(scale_name("gate_proj")), stacked.pop(scale_name("up_proj"))]
        fused[scale_name("gate_up_proj")] = jnp.stack(gate_up, axis=-1).reshape(n, -1)
        fused |= {scale_name(name): stacked.pop(scale_name(name)) for name in ("o_proj", "down_proj")}
        fused = transpose_quantized(fused)
    return fused


def unstack_layers(stacked: dict, num_layers: int) -> tuple:
    """The scan layout -> the unrolled one (a tuple of per-layer dicts), popping each stacked tensor
    from `stacked` once its slices exist (peak: the model plus one tensor's slices)."""
    layers = [{} for _ in range(num_layers)]
    for name in list(stacked):
        weight = stacked.pop(name)
        for i, layer in enumerate(layers):
            layer[name] = weight[i]
        del weight
    return tuple(layers)


def inference_layers(layers, config, *, execution: str | None = "unrolled"):
    """`layers` (any of the three layouts) in the inference layout of `execution`; None keeps the
    inference layout it is already in (fusing a checkpoint layout into the scan layout). A dict
    given is not modified."""
    if isinstance(layers, (tuple, list)):
        layers = tuple(layers)
        if execution == "scan":
            return jax.tree.map(lambda *xs: jnp.stack(xs), *layers)
        return layers
    layers = dict(layers)
    if "qkv_proj" not in layers:
        layers = fuse_layers(layers, config)
    return unstack_layers(layers, config.num_layers) if execution == "unrolled" else layers


def prepare_params(params: dict, config, *, execution: str = "unrolled") -> dict:
    """A whole parameter tree (checkpoint or inference layout) in the inference layout of
    `execution`. Takes ownership: `params` is emptied as its tensors move into the result, so a
    model converted on device peaks at about one model plus one group of projections."""
    check_execution(execution)
    layers = params.pop("layers")
    if isinstance(layers, dict):
        if "qkv_proj" not in layers:
            layers = fuse_layers(layers, config)
        if execution == "unrolled":
            layers = unstack_layers(layers, config.num_layers)
    else:
        layers = inference_layers(layers, config, execution=execution)
    prepared = transpose_quantized({name: params.pop(name) for name in list(params)})  # a quantized LM head
    return dict(prepared, layers=layers)


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
    """Shape of every stacked decoder-layer parameter of the checkpoint layout (module docstring)."""
    n, d, i = config.num_layers, config.hidden_size, config.intermediate_size
    h, kv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    shapes = {
        "attn_norm": (n, d), "q_proj": (n, d, h, hd), "k_proj": (n, d, kv, hd),
        "v_proj": (n, d, kv, hd), "o_proj": (n, h, hd, d), "mlp_norm": (n, d),
        "gate_proj": (n, d, i), "up_proj": (n, d, i), "down_proj": (n, i, d),
    }
    if config.qk_norm:
        shapes |= {"q_norm": (n, hd), "k_norm": (n, hd)}
    if config.qkv_bias:
        shapes |= {"q_bias": (n, h, hd), "k_bias": (n, kv, hd), "v_bias": (n, kv, hd)}
    return shapes


def inference_layer_shapes(config) -> dict[str, tuple[int, ...]]:
    """Shape of one layer's parameters in the inference layout (module docstring)."""
    d, i, hd = config.hidden_size, config.intermediate_size, config.head_dim
    h, kv = config.num_heads, config.num_kv_heads
    shapes = {"attn_norm": (d,), "qkv_proj": (d, (h + 2 * kv) * hd), "o_proj": (h * hd, d), "mlp_norm": (d,),
              "gate_up_proj": (d, 2 * i), "down_proj": (i, d)}
    if config.qk_norm:
        shapes |= {"q_norm": (hd,), "k_norm": (hd,)}
    if config.qkv_bias:
        shapes |= {"qkv_bias": ((h + 2 * kv) * hd,)}
    return quantized_inference_shapes(shapes, QUANTIZED_INFERENCE) if config.quantize else shapes


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
    if config.tie_word_embeddings:
        return jnp.matmul(x, params["embed"].T, precision=matmul_precision(x.dtype)).astype(jnp.float32)
    return linear(x, params, "lm_head", precision=matmul_precision(x.dtype)).astype(jnp.float32)


def layer_params(shapes: dict, *, dtype, rngs: nnx.Rngs, quantize: str | None = None) -> dict:
    """Random parameters of `shapes` (norms 1, weights normal(0.02)), as nnx.Params; with `quantize`, each
    weight whose `<name>_scale` `shapes` holds (stored [..., out, in]) is that random weight quantized."""
    init = nnx.initializers.normal(stddev=0.02)
    values = {name: jnp.ones(shape, dtype) if name.endswith("norm") else init(rngs.params(), shape, dtype)
              for name, shape in shapes.items() if not (quantize and is_scale(name))}
    for name in [n for n in values if quantize and scale_name(n) in shapes]:
        values[name], values[scale_name(name)] = quantize_weight(values[name], (values[name].ndim - 1,), quantize)
    return {name: nnx.Param(values[name]) for name in shapes}


class DecoderLayer(nnx.Module):
    """One decoder layer's parameters in the inference layout (one `nnx.Param` per weight); with
    `num_layers`, all layers' stacked on a leading axis (the scan execution)."""

    def __init__(self, config, *, dtype, rngs: nnx.Rngs, num_layers: int | None = None):
        lead = () if num_layers is None else (num_layers,)
        shapes = {name: lead + shape for name, shape in inference_layer_shapes(config).items()}
        for name, param in layer_params(shapes, dtype=dtype, rngs=rngs, quantize=config.quantize).items():
            setattr(self, name, param)


class DecoderLM(nnx.Module):
    """Parameters of a decoder LM: embedding, layers, final norm, LM head (absent if tied), in the
    inference layout of `execution` ("unrolled": one `DecoderLayer` per layer; "scan": one stacked).

    `dtype` is both the parameter and the compute dtype. Subclasses add the forward passes.
    Built from a checkpoint by `dllm_jax.load_model` (random init here only for tests and demos).
    """

    def __init__(self, config, *, dtype=jnp.bfloat16, rngs: nnx.Rngs, execution: str = "unrolled"):
        check_execution(execution)
        self.config = config
        self.execution = execution
        self.mesh = None  # the Mesh its weights are placed on (set by dllm_jax.checkpoint.model_from_params)
        init = nnx.initializers.normal(stddev=0.02)
        self.embed = nnx.Param(init(rngs.params(), (config.vocab_size, config.hidden_size), dtype))
        self.layers = self.make_layers(config, dtype=dtype, rngs=rngs)
        self.final_norm = nnx.Param(jnp.ones((config.hidden_size,), dtype))
        if not config.tie_word_embeddings:  # quantized: stored [vocab, hidden], a scale per vocabulary row
            shapes = {"lm_head": (config.hidden_size, config.vocab_size)}
            if config.quantize:
                shapes = quantized_inference_shapes(shapes, ("lm_head",))
            for name, param in layer_params(shapes, dtype=dtype, rngs=rngs, quantize=config.quantize).items():
                setattr(self, name, param)

    def make_layers(self, config, *, dtype, rngs: nnx.Rngs):
        """The decoder layers' parameters in the inference layout of `self.execution` (a family whose
        layers differ, such as LLaDA2's dense and MoE ones, overrides this and `layer_values`)."""
        if self.execution == "unrolled":
            return nnx.List([DecoderLayer(config, dtype=dtype, rngs=rngs) for _ in range(config.num_layers)])
        return DecoderLayer(config, dtype=dtype, rngs=rngs, num_layers=config.num_layers)

    @property
    def dtype(self):
        return self.embed[...].dtype

    def params(self) -> dict:
        """The parameter tree as plain arrays in the inference layout (a tuple of per-layer dicts when
        unrolled, see the module docstring). Read attribute by attribute: `nnx.state` over a few hundred
        per-layer variables costs milliseconds of host time per call, which a block step would pay."""
        tree = {name: getattr(self, name).get_value() for name in ("embed", "final_norm", "lm_head", "lm_head_scale")
                if hasattr(self, name)}
        return dict(tree, layers=self.layer_values())

    def layer_values(self):
        """The layers' weights as plain arrays: one dict per layer (unrolled) or one stacked dict (scan)."""
        def values(module, names):
            return {name: getattr(module, name).get_value() for name in names}

        names = list(inference_layer_shapes(self.config))
        return values(self.layers, names) if self.execution == "scan" else tuple(
            values(layer, names) for layer in self.layers)


def to_module_tree(params: dict) -> dict:
    """The inference tree -> nnx's pure dict (what `nnx.replace_by_pure_dict` takes)."""
    layers = params["layers"]
    if isinstance(layers, tuple):
        return dict(params, layers=dict(enumerate(layers)))
    return params
