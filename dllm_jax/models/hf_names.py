"""The Hugging Face tensor names of every family's checkpoint: one name map (data) per family, read by
`dllm_jax.checkpoint.hf` through the family's entry in `dllm_jax.families` (`hf_rules`, `hf_expected`).

Each rule maps an HF tensor name (regex; group 1 is the layer index for per-layer weights) to a path
in the checkpoint-layout parameter tree (`param_shapes` of the family's model) and a layout transform.
"""

from __future__ import annotations

import dataclasses

from dllm_jax.models.diffusion_gemma_weights import GROUPS


@dataclasses.dataclass(frozen=True)
class Rule:
    pattern: str  # regex over the full HF name; group 1 = layer index if `per_layer`
    path: tuple[str, ...]  # where the tensor goes in the parameter tree
    transform: str  # "copy" | "transpose" | "heads_in" | "heads_out" | "heads_bias"

    @property
    def per_layer(self) -> bool:
        return self.path[0] == "layers"


# Torch Linear weights are [out, in]; Flax kernels are [in, out]. Attention projections are
# further split by head: q/k/v [H*D, d] -> [d, H, D]; the output projection [d, H*D] -> [H, D, d].
LLADA_RULES = (
    Rule(r"model\.transformer\.wte\.weight", ("embed",), "copy"),
    Rule(r"model\.transformer\.blocks\.(\d+)\.attn_norm\.weight", ("layers", "attn_norm"), "copy"),
    Rule(r"model\.transformer\.blocks\.(\d+)\.q_proj\.weight", ("layers", "q_proj"), "heads_in"),
    Rule(r"model\.transformer\.blocks\.(\d+)\.k_proj\.weight", ("layers", "k_proj"), "heads_in"),
    Rule(r"model\.transformer\.blocks\.(\d+)\.v_proj\.weight", ("layers", "v_proj"), "heads_in"),
    Rule(r"model\.transformer\.blocks\.(\d+)\.attn_out\.weight", ("layers", "o_proj"), "heads_out"),
    Rule(r"model\.transformer\.blocks\.(\d+)\.ff_norm\.weight", ("layers", "mlp_norm"), "copy"),
    Rule(r"model\.transformer\.blocks\.(\d+)\.ff_proj\.weight", ("layers", "gate_proj"), "transpose"),
    Rule(r"model\.transformer\.blocks\.(\d+)\.up_proj\.weight", ("layers", "up_proj"), "transpose"),
    Rule(r"model\.transformer\.blocks\.(\d+)\.ff_out\.weight", ("layers", "down_proj"), "transpose"),
    Rule(r"model\.transformer\.ln_f\.weight", ("final_norm",), "copy"),
    Rule(r"model\.transformer\.ff_out\.weight", ("lm_head",), "transpose"),
)


# SDAR / TraDo use HF Qwen3 names (Qwen3ForCausalLM), one to one.
SDAR_RULES = (
    Rule(r"model\.embed_tokens\.weight", ("embed",), "copy"),
    Rule(r"model\.layers\.(\d+)\.input_layernorm\.weight", ("layers", "attn_norm"), "copy"),
    Rule(r"model\.layers\.(\d+)\.self_attn\.q_proj\.weight", ("layers", "q_proj"), "heads_in"),
    Rule(r"model\.layers\.(\d+)\.self_attn\.k_proj\.weight", ("layers", "k_proj"), "heads_in"),
    Rule(r"model\.layers\.(\d+)\.self_attn\.v_proj\.weight", ("layers", "v_proj"), "heads_in"),
    Rule(r"model\.layers\.(\d+)\.self_attn\.o_proj\.weight", ("layers", "o_proj"), "heads_out"),
    Rule(r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", ("layers", "q_norm"), "copy"),
    Rule(r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", ("layers", "k_norm"), "copy"),
    Rule(r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", ("layers", "mlp_norm"), "copy"),
    Rule(r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", ("layers", "gate_proj"), "transpose"),
    Rule(r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", ("layers", "up_proj"), "transpose"),
    Rule(r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", ("layers", "down_proj"), "transpose"),
    Rule(r"model\.norm\.weight", ("final_norm",), "copy"),
    Rule(r"lm_head\.weight", ("lm_head",), "transpose"),
)


# Dream uses HF Qwen2 names: SDAR's without q_norm / k_norm, plus the q/k/v biases ([H*D] -> [H, D]).
DREAM_RULES = tuple(r for r in SDAR_RULES if r.path[-1] not in ("q_norm", "k_norm")) + (
    Rule(r"model\.layers\.(\d+)\.self_attn\.q_proj\.bias", ("layers", "q_bias"), "heads_bias"),
    Rule(r"model\.layers\.(\d+)\.self_attn\.k_proj\.bias", ("layers", "k_bias"), "heads_bias"),
    Rule(r"model\.layers\.(\d+)\.self_attn\.v_proj\.bias", ("layers", "v_bias"), "heads_bias"),
)


# LLaDA2 (official modeling_llada2_moe.py names). Paths name the tree of dllm_jax.models.llada2: "layers"
# (every layer's attention, index = layer), "dense" (layers < first_k_dense_replace), "moe" (the others,
# index = layer - first_k_dense_replace; routed experts stacked at index (moe layer, expert): group 2).
LLADA2_RULES = (
    Rule(r"model\.word_embeddings\.weight", ("embed",), "copy"),
    Rule(r"model\.layers\.(\d+)\.input_layernorm\.weight", ("layers", "attn_norm"), "copy"),
    Rule(r"model\.layers\.(\d+)\.attention\.query_key_value\.weight", ("layers", "qkv_proj"), "transpose"),
    Rule(r"model\.layers\.(\d+)\.attention\.query_key_value\.bias", ("layers", "qkv_bias"), "copy"),
    Rule(r"model\.layers\.(\d+)\.attention\.query_layernorm\.weight", ("layers", "q_norm"), "copy"),
    Rule(r"model\.layers\.(\d+)\.attention\.key_layernorm\.weight", ("layers", "k_norm"), "copy"),
    Rule(r"model\.layers\.(\d+)\.attention\.dense\.weight", ("layers", "o_proj"), "transpose"),
    Rule(r"model\.layers\.(\d+)\.attention\.dense\.bias", ("layers", "o_bias"), "copy"),
    Rule(r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", ("layers", "mlp_norm"), "copy"),
    Rule(r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", ("dense", "gate_proj"), "transpose"),
    Rule(r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", ("dense", "up_proj"), "transpose"),
    Rule(r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", ("dense", "down_proj"), "transpose"),
    Rule(r"model\.layers\.(\d+)\.mlp\.gate\.weight", ("moe", "router"), "transpose"),
    Rule(r"model\.layers\.(\d+)\.mlp\.gate\.expert_bias", ("moe", "expert_bias"), "copy"),
    Rule(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.weight", ("moe", "gate_proj"), "transpose"),
    Rule(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.up_proj\.weight", ("moe", "up_proj"), "transpose"),
    Rule(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.down_proj\.weight", ("moe", "down_proj"), "transpose"),
    Rule(r"model\.layers\.(\d+)\.mlp\.shared_experts\.gate_proj\.weight", ("moe", "shared_gate_proj"), "transpose"),
    Rule(r"model\.layers\.(\d+)\.mlp\.shared_experts\.up_proj\.weight", ("moe", "shared_up_proj"), "transpose"),
    Rule(r"model\.layers\.(\d+)\.mlp\.shared_experts\.down_proj\.weight", ("moe", "shared_down_proj"), "transpose"),
    Rule(r"model\.norm\.weight", ("final_norm",), "copy"),
    Rule(r"lm_head\.weight", ("lm_head",), "transpose"),
)


def llada2_expected(config, shapes: dict) -> dict:
    """{HF name: (rule, index into the stacked tree tensor or None, target shape)} of a LLaDA2 checkpoint:
    per-layer tensors go to "layers" (all layers), "dense" or "moe" by the layer's kind, routed experts
    to index (moe layer, expert) of the [Lm, E, ...] stacks."""
    k = config.first_k_dense_replace
    layers_of = {"layers": range(config.num_layers), "dense": range(k), "moe": range(k, config.num_layers)}
    expected = {}
    for rule in LLADA2_RULES:
        group, leaf = rule.path[0], rule.path[-1]
        if group not in shapes or (group in layers_of and leaf not in shapes[group]):
            continue  # an optional tensor this config has not (biases, q/k norms, shared experts, a tied head)
        full = tree_get(shapes, rule.path)
        name = rule.pattern.replace("\\.", ".")
        if group not in layers_of:
            expected[name] = (rule, None, full)
            continue
        for layer in layers_of[group]:
            index = layer - k if group == "moe" else layer
            one = name.replace(r"(\d+)", str(layer), 1)
            if r"(\d+)" not in one:
                expected[one] = (rule, index, full[1:])
                continue
            for e in range(config.num_experts):  # routed experts: one tensor per expert
                expected[one.replace(r"(\d+)", str(e))] = (rule, (index, e), full[2:])
    return expected


# DiffusionGemma (transformers' DiffusionGemmaForBlockDiffusion): the decoder's copy of the text weights, each layer
# type's stacked apart ("sliding", "global": dllm_jax.models.diffusion_gemma_weights), so every per-layer rule comes
# once per group; the experts' tensors keep transformers' layout ("copy").
DECODER_LAYER = r"model\.decoder\.layers\.(\d+)\."
DIFFUSION_GEMMA_LAYER = {  # leaf -> (HF name after the layer prefix, transform)
    "attn_norm": ("input_layernorm.weight", "copy"), "q_proj": ("self_attn.q_proj.weight", "transpose"),
    "k_proj": ("self_attn.k_proj.weight", "transpose"), "v_proj": ("self_attn.v_proj.weight", "transpose"),
    "q_norm": ("self_attn.q_norm.weight", "copy"), "k_norm": ("self_attn.k_norm.weight", "copy"),
    "o_proj": ("self_attn.o_proj.weight", "transpose"), "post_attn_norm": ("post_attention_layernorm.weight", "copy"),
    "mlp_norm": ("pre_feedforward_layernorm.weight", "copy"), "gate_proj": ("mlp.gate_proj.weight", "transpose"),
    "up_proj": ("mlp.up_proj.weight", "transpose"), "down_proj": ("mlp.down_proj.weight", "transpose"),
    "post_mlp_norm": ("post_feedforward_layernorm_1.weight", "copy"), "router": ("router.proj.weight", "transpose"),
    "router_norm": ("router.scale", "copy"), "expert_scale": ("router.per_expert_scale", "copy"),
    "moe_norm": ("pre_feedforward_layernorm_2.weight", "copy"), "experts_gate_up": ("experts.gate_up_proj", "copy"),
    "experts_down": ("experts.down_proj", "copy"), "post_moe_norm": ("post_feedforward_layernorm_2.weight", "copy"),
    "post_ffw_norm": ("post_feedforward_layernorm.weight", "copy"), "decoder_scalar": ("layer_scalar", "copy"),
}
DIFFUSION_GEMMA_RULES = (
    Rule(r"model\.decoder\.embed_tokens\.weight", ("embed",), "copy"),
    Rule(r"model\.decoder\.norm\.weight", ("final_norm",), "copy"),
    Rule(r"model\.decoder\.self_conditioning\.pre_norm\.weight", ("self_conditioning", "pre_norm"), "copy"),
    Rule(r"model\.decoder\.self_conditioning\.gate_proj\.weight", ("self_conditioning", "gate_proj"), "transpose"),
    Rule(r"model\.decoder\.self_conditioning\.up_proj\.weight", ("self_conditioning", "up_proj"), "transpose"),
    Rule(r"model\.decoder\.self_conditioning\.down_proj\.weight", ("self_conditioning", "down_proj"), "transpose"),
) + tuple(Rule(DECODER_LAYER + name.replace(".", r"\."), (group, leaf), transform)
          for group in ("sliding", "global") for leaf, (name, transform) in DIFFUSION_GEMMA_LAYER.items()) + tuple(
    Rule(r"model\.encoder\.language_model\.layers\.(\d+)\.layer_scalar", (group, "encoder_scalar"), "copy")
    for group in ("sliding", "global"))
# what a DiffusionGemma checkpoint may hold that is not read: the vision tower, and the copies tied to the
# decoder's (the encoder's text weights, the LM head); the encoder's layer_scalars are read (expected first)
DIFFUSION_GEMMA_SKIPPED = (r"model\.encoder\.(vision_tower|embed_vision)\..*", r"model\.encoder\.language_model\..*",
                           r"lm_head\.weight")


def diffusion_gemma_expected(config, shapes: dict) -> dict:
    """{HF name: (rule, index into its group's stack or None, target shape)} of a DiffusionGemma checkpoint: layer
    l's tensors go to its type's group at index (the layers of that type before it)."""
    expected = {}
    for rule in DIFFUSION_GEMMA_RULES:
        group, leaf = rule.path[0], rule.path[-1]
        name = rule.pattern.replace("\\.", ".")
        if group not in ("sliding", "global"):
            expected[name] = (rule, None, tree_get(shapes, rule.path))
            continue
        if group not in shapes or leaf not in shapes[group]:
            continue  # a layer type the config has not, or a global layer's absent v_proj
        layers = [layer for layer, kind in enumerate(config.layer_types) if GROUPS[kind] == group]
        for index, layer in enumerate(layers):
            expected[name.replace(r"(\d+)", str(layer))] = (rule, index, shapes[group][leaf][1:])
    return expected


def tree_get(tree: dict, path: tuple[str, ...]):
    for key in path:
        tree = tree[key]
    return tree
