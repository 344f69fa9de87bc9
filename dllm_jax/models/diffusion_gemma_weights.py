"""DiffusionGemma's weights: the checkpoint layout (what conversion stores, `param_shapes`) and the inference tree
the functions of `dllm_jax.models.diffusion_gemma` read (`prepare_params`). transformers' tensor names are its
name map in `dllm_jax.models.hf_names` (`DIFFUSION_GEMMA_RULES`, `diffusion_gemma_expected`).

Checkpoint layout: sliding and global layers differ in head_dim, KV heads and the value projection (a global
layer has none), so each layer type's weights are stacked apart, in "sliding" and "global" groups ([Ls, ...] and
[Lg, ...]: the k-th layer of that type at index k); weights [in, out], except the experts', kept as transformers
stores them ([E, 2 Im, d] gate and up, [E, d, Im] down). transformers keeps one copy of the text weights, under
`model.decoder.` (the encoder's `model.encoder.language_model.` tensors and `lm_head.weight` are tied to them):
that copy is read; the untied exceptions are each layer's `layer_scalar` (the encoder's and the decoder's are
both read) and the decoder's self-conditioning block. Vision-tower tensors are skipped.

Inference tree (d hidden, I intermediate, E experts, Im expert intermediate, V vocabulary; per layer H query
heads, K key/value heads of D dims; weights [in, out]):
  embed [V, d]; final_norm [d];
  self_conditioning: pre_norm [d], gate_up_proj [d, 2I], down_proj [I, d];
  layers: a tuple with one dict per layer:
    attn_norm [d], q_proj [d, H D], k_proj [d, K D], v_proj [d, K D] (sliding layers only: a global layer's
    values are its keys before k_norm), q_norm / k_norm [D], o_proj [H D, d], post_attn_norm [d],
    mlp_norm [d], gate_up_proj [d, 2I], down_proj [I, d], post_mlp_norm [d] (the dense MLP),
    router [d, E], router_norm [d] (the router input's norm weight), expert_scale [E], moe_norm [d],
    experts_gate_up [E, d, 2Im], experts_down [E, Im, d], post_moe_norm [d] (the experts), post_ffw_norm [d]
    (their sum), encoder_scalar [], decoder_scalar [] (each stack's layer_scalar).
Gate and up projections are interleaved into one matrix (column 2j gate j, 2j + 1 up j), the layout
`dllm_jax.models.moe` dispatches for.

Quantized weights (`config.quantize`, `dllm_jax.quantize`): the projections of attention, of the dense and the
self-conditioning MLPs and the experts (`QUANTIZED`), each with a float32 scale per output channel (per expert and
output channel for the experts); in the inference tree each is stored [out, in] beside its `<name>_scale`. The
tied embedding (also the LM head), the router and the norms keep the parameter dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dllm_jax.diffusion_gemma_config import GLOBAL, SLIDING, DiffusionGemmaConfig
from dllm_jax.models.layers import interleave
from dllm_jax.quantize import SCALE, quantized_shapes, stored_dtypes, transpose_quantized

GROUPS = {SLIDING: "sliding", GLOBAL: "global"}  # layer type -> its group of stacked weights

# quantized weights in the checkpoint layout, with the axes each GEMM contracts (after the layer axis; the
# experts' [E, out, in] after their expert axis too); a global layer has no v_proj (skipped where absent)
LAYER_QUANTIZED = {"q_proj": (1,), "k_proj": (1,), "v_proj": (1,), "o_proj": (1,), "gate_proj": (1,),
                   "up_proj": (1,), "down_proj": (1,), "experts_gate_up": (3,), "experts_down": (3,)}
QUANTIZED = {"sliding": LAYER_QUANTIZED, "global": LAYER_QUANTIZED,
             "self_conditioning": {"gate_proj": (0,), "up_proj": (0,), "down_proj": (0,)}}


def layer_shapes(config: DiffusionGemmaConfig, layer: int) -> dict:
    """One layer's checkpoint-layout weights {leaf: shape} (the layer's type decides D, K and v_proj)."""
    d, i, e, im = config.hidden_size, config.intermediate_size, config.num_experts, config.moe_intermediate_size
    h, kv, hd = config.num_heads, config.kv_heads[layer], config.head_dims[layer]
    shapes = dict(attn_norm=(d,), q_proj=(d, h * hd), k_proj=(d, kv * hd), v_proj=(d, kv * hd), q_norm=(hd,),
                  k_norm=(hd,), o_proj=(h * hd, d), post_attn_norm=(d,), mlp_norm=(d,), gate_proj=(d, i),
                  up_proj=(d, i), down_proj=(i, d), post_mlp_norm=(d,), router=(d, e), router_norm=(d,),
                  expert_scale=(e,), moe_norm=(d,), experts_gate_up=(e, 2 * im, d), experts_down=(e, d, im),
                  post_moe_norm=(d,), post_ffw_norm=(d,), decoder_scalar=(1,), encoder_scalar=(1,))
    if not config.is_sliding(layer):
        del shapes["v_proj"]
    return shapes


def interleave_gate_up(p: dict, gate: str, up: str, out: str) -> dict:
    """p with `gate` and `up` [..., in, n] (and their scales [..., n] where quantized) interleaved into `out`."""
    p = dict(p)
    for x in ("", SCALE) if gate + SCALE in p else ("",):
        p[out + x] = interleave(p.pop(gate + x), p.pop(up + x))
    return p


def param_shapes(config: DiffusionGemmaConfig) -> dict:
    """The checkpoint-layout shapes (module docstring): embed, final_norm, self_conditioning, and a group of
    stacked weights per layer type present (with the scales of `QUANTIZED`'s weights where `config.quantize`)."""
    d, i = config.hidden_size, config.intermediate_size
    shapes = dict(embed=(config.vocab_size, d), final_norm=(d,),
                  self_conditioning=dict(pre_norm=(d,), gate_proj=(d, i), up_proj=(d, i), down_proj=(i, d)))
    for kind, group in GROUPS.items():
        layers = [layer for layer, t in enumerate(config.layer_types) if t == kind]
        if layers:  # one shape per type (the config checks it)
            shapes[group] = {leaf: (len(layers), *shape) for leaf, shape in layer_shapes(config, layers[0]).items()}
    return quantized_shapes(shapes, QUANTIZED) if config.quantize else shapes


def inference_layer(p: dict) -> dict:
    """One layer's checkpoint-layout weights -> its inference dict (module docstring)."""
    p = interleave_gate_up(p, "gate_proj", "up_proj", "gate_up_proj")
    # the experts as [E, in, out] like every other weight (a quantized one goes back to [E, out, in] below)
    p["experts_gate_up"] = interleave(*jnp.split(jnp.swapaxes(p["experts_gate_up"], -1, -2), 2, axis=-1))
    p["experts_down"] = jnp.swapaxes(p["experts_down"], -1, -2)
    if "experts_gate_up" + SCALE in p:
        p["experts_gate_up" + SCALE] = interleave(*jnp.split(p["experts_gate_up" + SCALE], 2, axis=-1))
    p["decoder_scalar"], p["encoder_scalar"] = p["decoder_scalar"].reshape(()), p["encoder_scalar"].reshape(())
    return transpose_quantized(p)


def prepare_params(params: dict, config: DiffusionGemmaConfig, *, execution: str = "unrolled") -> dict:
    """A parameter tree (checkpoint or inference layout) in the inference layout. Takes ownership: the groups are
    emptied leaf by leaf as the layers take their slices (peak: the model plus one stacked leaf). The layers run
    unrolled only (their shapes differ by type, so one `lax.scan` body cannot hold them: the family's `executions`)."""
    if isinstance(params.get("layers"), tuple):
        return params
    rows = [{} for _ in config.layer_types]
    for kind, group in GROUPS.items():
        stack = params.pop(group, {})
        layers = [layer for layer, t in enumerate(config.layer_types) if t == kind]
        for leaf in list(stack):
            values = stack.pop(leaf)
            for k, layer in enumerate(layers):
                rows[layer][leaf] = values[k]
    conditioning = transpose_quantized(interleave_gate_up(params.pop("self_conditioning"), "gate_proj", "up_proj",
                                                          "gate_up_proj"))
    return dict(embed=params.pop("embed"), final_norm=params.pop("final_norm"), self_conditioning=conditioning,
                layers=tuple(inference_layer(row) for row in rows))


def inference_shapes(config: DiffusionGemmaConfig, dtype) -> dict:
    """The inference tree's shapes, as jax.ShapeDtypeStruct leaves (nothing is computed): `dtype`, or the storage
    dtype and float32 scales of quantized weights."""
    shapes = param_shapes(config)
    dtypes = stored_dtypes(shapes, QUANTIZED, config.quantize, dtype)
    abstract = jax.tree.map(jax.ShapeDtypeStruct, shapes, dtypes, is_leaf=lambda x: isinstance(x, tuple))
    return jax.eval_shape(lambda p: prepare_params(p, config), abstract)


def to_module_tree(params: dict) -> dict:
    """The inference tree -> nnx's pure dict (what `nnx.replace_by_pure_dict` takes)."""
    return dict(params, layers=dict(enumerate(params["layers"])))


__all__ = ["QUANTIZED", "param_shapes", "prepare_params", "to_module_tree", "inference_shapes"]
