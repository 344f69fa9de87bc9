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
    router [d, E], router_scale [d], expert_scale [E], moe_norm [d], experts_gate_up [E, d, 2Im],
    experts_down [E, Im, d], post_moe_norm [d] (the experts), post_ffw_norm [d] (their sum),
    encoder_scalar [], decoder_scalar [] (each stack's layer_scalar).
Gate and up projections are interleaved into one matrix (column 2j gate j, 2j + 1 up j), the layout
`dllm_jax.models.moe` dispatches for.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dllm_jax.diffusion_gemma_config import GLOBAL, SLIDING, DiffusionGemmaConfig

GROUPS = {SLIDING: "sliding", GLOBAL: "global"}  # layer type -> its group of stacked weights


def layer_shapes(config: DiffusionGemmaConfig, layer: int) -> dict:
    """One layer's checkpoint-layout weights {leaf: shape} (the layer's type decides D, K and v_proj)."""
    d, i, e, im = config.hidden_size, config.intermediate_size, config.num_experts, config.moe_intermediate_size
    h, kv, hd = config.num_heads, config.kv_heads[layer], config.head_dims[layer]
    shapes = dict(attn_norm=(d,), q_proj=(d, h * hd), k_proj=(d, kv * hd), v_proj=(d, kv * hd), q_norm=(hd,),
                  k_norm=(hd,), o_proj=(h * hd, d), post_attn_norm=(d,), mlp_norm=(d,), gate_proj=(d, i),
                  up_proj=(d, i), down_proj=(i, d), post_mlp_norm=(d,), router=(d, e), router_scale=(d,),
                  expert_scale=(e,), moe_norm=(d,), experts_gate_up=(e, 2 * im, d), experts_down=(e, d, im),
                  post_moe_norm=(d,), post_ffw_norm=(d,), decoder_scalar=(1,), encoder_scalar=(1,))
    if not config.is_sliding(layer):
        del shapes["v_proj"]
    return shapes


def param_shapes(config: DiffusionGemmaConfig) -> dict:
    """The checkpoint-layout shapes (module docstring): embed, final_norm, self_conditioning, and a group of
    stacked weights per layer type present."""
    d, i = config.hidden_size, config.intermediate_size
    shapes = dict(embed=(config.vocab_size, d), final_norm=(d,),
                  self_conditioning=dict(pre_norm=(d,), gate_proj=(d, i), up_proj=(d, i), down_proj=(i, d)))
    for kind, group in GROUPS.items():
        layers = [layer for layer, t in enumerate(config.layer_types) if t == kind]
        if layers:  # one shape per type (the config checks it)
            shapes[group] = {leaf: (len(layers), *shape) for leaf, shape in layer_shapes(config, layers[0]).items()}
    return shapes


def interleave(gate, up):
    """[..., n] and [..., n] -> [..., 2n] with column 2j gate j and 2j + 1 up j."""
    return jnp.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)


def inference_layer(p: dict) -> dict:
    """One layer's checkpoint-layout weights -> its inference dict (module docstring)."""
    p = dict(p)
    p["gate_up_proj"] = interleave(p.pop("gate_proj"), p.pop("up_proj"))
    p["experts_gate_up"] = interleave(*jnp.split(jnp.swapaxes(p["experts_gate_up"], -1, -2), 2, axis=-1))
    p["experts_down"] = jnp.swapaxes(p["experts_down"], -1, -2)
    p["decoder_scalar"], p["encoder_scalar"] = p["decoder_scalar"].reshape(()), p["encoder_scalar"].reshape(())
    return p


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
    sc = params.pop("self_conditioning")
    return dict(embed=params.pop("embed"), final_norm=params.pop("final_norm"),
                self_conditioning=dict(pre_norm=sc["pre_norm"], gate_up_proj=interleave(sc["gate_proj"], sc["up_proj"]),
                                       down_proj=sc["down_proj"]),
                layers=tuple(inference_layer(row) for row in rows))


def inference_shapes(config: DiffusionGemmaConfig, dtype) -> dict:
    """The inference tree's shapes, as jax.ShapeDtypeStruct leaves (nothing is computed)."""
    abstract = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype), param_shapes(config),
                            is_leaf=lambda x: isinstance(x, tuple))
    return jax.eval_shape(lambda p: prepare_params(p, config), abstract)


def to_module_tree(params: dict) -> dict:
    """The inference tree -> nnx's pure dict (what `nnx.replace_by_pure_dict` takes)."""
    return dict(params, layers=dict(enumerate(params["layers"])))


__all__ = ["param_shapes", "prepare_params", "to_module_tree", "inference_shapes"]
