"""DiffusionGemma's weights: transformers' safetensors names -> the JAX parameter tree.

transformers keeps one copy of the text weights, under `model.decoder.` (the encoder's
`model.encoder.language_model.` tensors are tied to them, and so is `lm_head.weight` to the embedding); a file
holding only the encoder's copy of a tensor is read from there. Two things are not tied: each layer's
`layer_scalar` (a buffer: the encoder's and the decoder's are read separately) and the decoder's
self-conditioning block (the decoder's alone). Vision-tower tensors (`model.encoder.vision_tower.`,
`model.encoder.embed_vision.`) are ignored.

Parameter tree (d hidden, I intermediate, E experts, Im expert intermediate, V vocabulary; per layer H query
heads, K key/value heads of D dims; weights [in, out]):
  embed [V, d]; final_norm [d];
  self_conditioning: pre_norm [d], gate_up_proj [d, 2I], down_proj [I, d];
  layers: a tuple with one dict per layer (sliding and global layers differ in D, K and v_proj):
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

import json
import os

import jax.numpy as jnp
import numpy as np

from dllm_jax.models.diffusion_gemma_config import DiffusionGemmaConfig, from_hf_config

DECODER = "model.decoder."
ENCODER = "model.encoder.language_model."
IGNORED = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
TIED_HEAD = "lm_head.weight"


def interleave(gate, up):
    """[..., n] and [..., n] -> [..., 2n] with column 2j gate j and 2j + 1 up j."""
    return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], -1)


def sources(config: DiffusionGemmaConfig) -> dict:
    """HF name (without its stack prefix) -> (parameter path, HF shape, transform to the tree's layout)."""
    d, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    e, im = config.num_experts, config.moe_intermediate_size
    rows = {"embed_tokens.weight": (("embed",), (v, d), np.asarray), "norm.weight": (("final_norm",), (d,), np.asarray)}
    for layer in range(config.num_layers):
        h, kv, hd = config.num_heads, config.kv_heads[layer], config.head_dims[layer]
        p = f"layers.{layer}."
        named = {
            "input_layernorm.weight": ("attn_norm", (d,)), "self_attn.q_proj.weight": ("q_proj", (h * hd, d)),
            "self_attn.k_proj.weight": ("k_proj", (kv * hd, d)), "self_attn.q_norm.weight": ("q_norm", (hd,)),
            "self_attn.k_norm.weight": ("k_norm", (hd,)), "self_attn.o_proj.weight": ("o_proj", (d, h * hd)),
            "post_attention_layernorm.weight": ("post_attn_norm", (d,)),
            "pre_feedforward_layernorm.weight": ("mlp_norm", (d,)), "mlp.down_proj.weight": ("down_proj", (d, i)),
            "post_feedforward_layernorm_1.weight": ("post_mlp_norm", (d,)), "router.proj.weight": ("router", (e, d)),
            "router.scale": ("router_scale", (d,)), "router.per_expert_scale": ("expert_scale", (e,)),
            "pre_feedforward_layernorm_2.weight": ("moe_norm", (d,)),
            "post_feedforward_layernorm_2.weight": ("post_moe_norm", (d,)),
            "post_feedforward_layernorm.weight": ("post_ffw_norm", (d,)),
        }
        if config.is_sliding(layer):
            named["self_attn.v_proj.weight"] = ("v_proj", (kv * hd, d))
        for hf, (name, shape) in named.items():
            rows[p + hf] = (("layers", layer, name), shape, np.transpose if len(shape) == 2 else np.asarray)
        rows[p + "experts.gate_up_proj"] = (("layers", layer, "experts_gate_up"), (e, 2 * im, d),
                                            lambda w: interleave(*np.split(np.swapaxes(w, 1, 2), 2, axis=-1)))
        rows[p + "experts.down_proj"] = (("layers", layer, "experts_down"), (e, d, im), lambda w: np.swapaxes(w, 1, 2))
    return rows


def paired(config: DiffusionGemmaConfig) -> dict:
    """Parameters built from a gate and an up projection: path -> (gate name, up name, HF shape of each)."""
    d, i = config.hidden_size, config.intermediate_size
    pairs = {("self_conditioning", "gate_up_proj"): ("self_conditioning.gate_proj.weight",
                                                      "self_conditioning.up_proj.weight")}
    for layer in range(config.num_layers):
        pairs[("layers", layer, "gate_up_proj")] = (f"layers.{layer}.mlp.gate_proj.weight",
                                                    f"layers.{layer}.mlp.up_proj.weight")
    return {path: (gate, up, (i, d)) for path, (gate, up) in pairs.items()}


def take_exact(tensors: dict, full: str, shape: tuple, used: set) -> np.ndarray:
    if full not in tensors:
        raise ValueError(f"checkpoint lacks the tensor {full!r}")
    value = np.asarray(tensors[full])
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"tensor {full!r} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    used.add(full)
    return value


def take(tensors: dict, name: str, shape: tuple, used: set, *, tied: bool = True) -> np.ndarray:
    """The decoder's tensor `name` (or, when tied and the file lacks it, the encoder's copy), shape-checked."""
    encoder_only = tied and DECODER + name not in tensors and ENCODER + name in tensors
    return take_exact(tensors, (ENCODER if encoder_only else DECODER) + name, shape, used)


def check_all_used(tensors: dict, used: set) -> None:
    """Every tensor is read, a tied copy of one read, or ignored (vision); anything else is a ValueError."""
    def known(name):
        if name in used or name.startswith(IGNORED):
            return True
        if name == TIED_HEAD:
            return DECODER + "embed_tokens.weight" in used or ENCODER + "embed_tokens.weight" in used
        return name.startswith(ENCODER) and DECODER + name[len(ENCODER):] in used

    unexpected = sorted(name for name in tensors if not known(name))
    if unexpected:
        raise ValueError(f"checkpoint holds {len(unexpected)} unexpected tensors: {unexpected[:8]}")


def put(tree: dict, path: tuple, value) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def params_from_hf(tensors: dict, config: DiffusionGemmaConfig, *, dtype=None) -> dict:
    """The parameter tree (module docstring) of transformers' tensors {name: array} (numpy, as
    `safetensors.numpy` loads them), cast to `dtype` (default: as stored). A missing, misshaped or
    unexpected tensor is a ValueError naming it."""
    used: set = set()
    tree: dict = {}
    for name, (path, shape, transform) in sources(config).items():
        put(tree, path, transform(take(tensors, name, shape, used)))
    for path, (gate, up, shape) in paired(config).items():
        tied = path[0] != "self_conditioning"
        put(tree, path, interleave(take(tensors, gate, shape, used, tied=tied).T,
                                   take(tensors, up, shape, used, tied=tied).T))
    d, i = config.hidden_size, config.intermediate_size
    put(tree, ("self_conditioning", "pre_norm"), take(tensors, "self_conditioning.pre_norm.weight", (d,), used,
                                                      tied=False))
    put(tree, ("self_conditioning", "down_proj"), take(tensors, "self_conditioning.down_proj.weight", (d, i), used,
                                                       tied=False).T)
    for layer in range(config.num_layers):
        scalar = f"layers.{layer}.layer_scalar"
        put(tree, ("layers", layer, "decoder_scalar"), take(tensors, scalar, (1,), used, tied=False).reshape(()))
        put(tree, ("layers", layer, "encoder_scalar"), take_exact(tensors, ENCODER + scalar, (1,), used).reshape(()))
    check_all_used(tensors, used)
    cast = (lambda x: jnp.asarray(x)) if dtype is None else (lambda x: jnp.asarray(x, dtype))
    layers = tuple(jax_tree(tree["layers"][layer], cast) for layer in range(config.num_layers))
    return dict(jax_tree({k: v for k, v in tree.items() if k != "layers"}, cast), layers=layers)


def jax_tree(tree: dict, cast) -> dict:
    return {k: jax_tree(v, cast) if isinstance(v, dict) else cast(v) for k, v in tree.items()}


def read_safetensors(path: str) -> dict:
    """Every tensor of a checkpoint folder's `*.safetensors` files (one file or shards) as numpy arrays."""
    from safetensors.numpy import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path} holds no .safetensors file")
    tensors: dict = {}
    for name in files:
        tensors.update(load_file(os.path.join(path, name)))
    return tensors


def load_checkpoint(path: str, *, dtype=None) -> tuple[DiffusionGemmaConfig, dict]:
    """(config, params) of a transformers DiffusionGemma checkpoint folder (config.json + safetensors)."""
    with open(os.path.join(path, "config.json")) as f:
        config = from_hf_config(json.load(f))
    return config, params_from_hf(read_safetensors(path), config, dtype=dtype)


__all__ = ["params_from_hf", "load_checkpoint", "read_safetensors"]
