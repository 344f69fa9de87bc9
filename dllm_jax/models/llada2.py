"""LLaDA2.0 / 2.1 (inclusionAI) in Flax NNX: a Ling 2.0 (BailingMoeV2) MoE decoder run as block diffusion.

Architecture (the official `modeling_llada2_moe.py`; facts in dllm_jax/configs/llada2.0-mini/README.md):
  * attention: one fused `query_key_value` projection ([all query heads | all key heads | all value
    heads] rows, optional bias), per-head q/k RMSNorm, RoPE on the first rotary_dim =
    head_dim * partial_rotary_factor dimensions of each head (half rotation; the rest pass through),
    scale 1/sqrt(head_dim), output projection `dense` (optional bias);
  * layers 0..first_k_dense_replace-1: a dense SwiGLU MLP; the others: a sparse MoE block, the routed
    experts' weighted sum plus the shared experts' SwiGLU of the same input;
  * router (`gate`), all in fp32: logits = x @ W^T, scores = sigmoid(logits); experts are selected on
    scores + expert_bias (the bias only selects): the n_group groups score by the sum of their top-2
    biased scores, the topk_group best groups are kept, then the top num_experts_per_tok experts among
    them; the weights are the *unbiased* scores of those experts, divided by their sum (+1e-20) when
    top-k > 1, times routed_scaling_factor. Expert outputs (in the activation dtype) are weighted and
    summed in fp32, then cast back.
Block diffusion: attention is bidirectional inside each block and causal across blocks (the official
sampler's `block_diffusion_attention_mask`), so the K/V of finished blocks never change and the cached
path (`prefill`, `block_step`, `commit_and_step`, on SDAR's static `KVCache`) equals the full forward.
That path and the full forward are SDAR's (`dllm_jax.models.sdar`), run with this family's `DECODER`
(its decoder stack, partial-rotary RoPE tables and parameter preparation); the module's host methods
are SDAR's `BlockDiffusionLM`.

Routed experts run as two grouped GEMMs over the token copies sorted by expert (`dllm_jax.models.moe`: a
Pallas kernel on the GPU, `jax.lax.ragged_dot` elsewhere): each touched expert's weights are read about
once for all its tokens, nothing is computed for unselected experts.

Parameter layouts (L layers, Ld = first_k_dense_replace dense ones, Lm = L - Ld MoE ones; E experts):
  * checkpoint layout (`param_shapes`, what the converter writes): "layers" stacks the attention of all
    L layers: attn_norm [L, d], qkv_proj [L, d, (H + 2K) D] (the HF row order, transposed),
    qkv_bias [L, (H + 2K) D], q_norm / k_norm [L, D], o_proj [L, H D, d], o_bias [L, d], mlp_norm [L, d];
    "dense": gate_proj / up_proj [Ld, d, I], down_proj [Ld, I, d]; "moe": router [Lm, d, E] (HF gate
    weight, transposed), expert_bias [Lm, E], gate_proj / up_proj [Lm, E, d, Im], down_proj
    [Lm, E, Im, d] (experts stacked at conversion), shared_gate_proj / shared_up_proj [Lm, d, Is],
    shared_down_proj [Lm, Is, d] (Is = num_shared_experts * Im).
  * inference layout (`prepare_params`): a tuple of per-layer dicts; qkv_proj regrouped per KV head
    as `dllm_jax.models.layers` does (each KV head's query heads, its key, its value), gate/up pairs
    interleaved into one matrix (gate_up_proj [d, 2I], experts_gate_up [E, d, 2Im], shared_gate_up
    [d, 2Is]) so one GEMM reads both and a contiguous split is a tensor-parallel shard.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dllm_jax.attention.dense import matmul_precision
from dllm_jax.attention.policy import AttentionPolicy, Dense
from dllm_jax.config import LLaDA2Config
from dllm_jax.models import block_diffusion
from dllm_jax.models.layers import (QUANTIZED_INFERENCE as DECODER_QUANTIZED, attention_sublayer, interleave,
                                    layer_params, mlp_sublayer, rms_norm, rope_tables, swiglu_gate)
from dllm_jax.models.moe import routed_experts
from dllm_jax.sharding import DECODER_AXES, traced_mesh
from dllm_jax.models.block_diffusion import (BlockDecoder, BlockDiffusionLM, KVCache, Segment, init_cache,
                                             init_policy_state)
from dllm_jax.quantize import SCALE, linear, quantized_inference_shapes, scale_name, transpose_quantized

__all__ = ["LLaDA2", "DECODER", "KVCache", "Segment", "forward", "prefill", "cached_forward", "block_step",
           "commit_and_step", "init_cache", "init_policy_state"]


# The logical axes of the inference layout (dllm_jax.sharding): every expert's hidden dimension over "tp"
# (each device holds a slice of all experts, so the routed tokens need no all-to-all; the sum of the
# slices' down projections is the layer's one all-reduce)
PARAM_AXES = DECODER_AXES | {
    "qkv_bias": ("tp",), "o_bias": (None,), "router": (None, None), "expert_bias": (None,),
    "experts_gate_up": (None, None, "tp"), "experts_down": (None, "tp", None),
    "shared_gate_up": (None, "tp"), "shared_down": ("tp", None)}

# quantized linear layers (dllm_jax.quantize), checkpoint layout with the axes each GEMM contracts (after the
# layer axis; the routed experts' after their expert axis too), and their inference names: attention, the dense
# layers' MLP, the routed experts (the grouped-GEMM kernel of dllm_jax.models.moe reads them in one byte) and the
# shared experts (the router stays in the parameter dtype)
QUANTIZED = {"layers": {"qkv_proj": (1,), "o_proj": (1,)},
             "dense": {"gate_proj": (1,), "up_proj": (1,), "down_proj": (1,)},
             "moe": {"gate_proj": (2,), "up_proj": (2,), "down_proj": (2,), "shared_gate_proj": (1,),
                     "shared_up_proj": (1,), "shared_down_proj": (1,)}, "lm_head": (0,)}
QUANTIZED_INFERENCE = DECODER_QUANTIZED + ("experts_gate_up", "experts_down", "shared_gate_up", "shared_down")


# --- parameter shapes and layouts ----------------------------------------------------------------

def attention_shapes(config: LLaDA2Config) -> dict[str, tuple[int, ...]]:
    """One layer's attention parameters in the checkpoint layout (no layer axis)."""
    d, h, kv, hd = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
    qkv = (h + 2 * kv) * hd
    shapes = {"attn_norm": (d,), "qkv_proj": (d, qkv), "o_proj": (h * hd, d), "mlp_norm": (d,)}
    if config.qkv_bias:
        shapes["qkv_bias"] = (qkv,)
    if config.o_bias:
        shapes["o_bias"] = (d,)
    if config.qk_norm:
        shapes |= {"q_norm": (hd,), "k_norm": (hd,)}
    return shapes


def moe_shapes(config: LLaDA2Config) -> dict[str, tuple[int, ...]]:
    """One MoE layer's MLP parameters in the checkpoint layout (no layer axis)."""
    d, e, im = config.hidden_size, config.num_experts, config.moe_intermediate_size
    shapes = {"router": (d, e), "expert_bias": (e,), "gate_proj": (e, d, im), "up_proj": (e, d, im),
              "down_proj": (e, im, d)}
    if config.num_shared_experts:
        s = config.num_shared_experts * im
        shapes |= {"shared_gate_proj": (d, s), "shared_up_proj": (d, s), "shared_down_proj": (s, d)}
    return shapes


def param_shapes(config: LLaDA2Config) -> dict:
    """Shapes of the checkpoint-layout parameter tree (module docstring)."""
    d, i = config.hidden_size, config.intermediate_size
    stack = lambda n, shapes: {name: (n, *shape) for name, shape in shapes.items()}  # noqa: E731
    shapes = {"embed": (config.vocab_size, d), "final_norm": (d,),
              "layers": stack(config.num_layers, attention_shapes(config))}
    if config.num_dense_layers:
        shapes["dense"] = stack(config.num_dense_layers, {"gate_proj": (d, i), "up_proj": (d, i), "down_proj": (i, d)})
    if config.num_moe_layers:
        shapes["moe"] = stack(config.num_moe_layers, moe_shapes(config))
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (d, config.vocab_size)
    return shapes


def group_qkv(w, config: LLaDA2Config):
    """The HF column order [all q | all k | all v] of w [..., (H + 2K) D] -> per KV head [its G query
    heads, its key, its value] (the layout `dllm_jax.models.layers` and the sharding table expect)."""
    h, kv, hd = config.num_heads, config.num_kv_heads, config.head_dim
    lead = w.shape[:-1]
    q = w[..., :h * hd].reshape(*lead, kv, h // kv, hd)
    k = w[..., h * hd:(h + kv) * hd].reshape(*lead, kv, 1, hd)
    v = w[..., (h + kv) * hd:].reshape(*lead, kv, 1, hd)
    return jnp.concatenate([q, k, v], axis=-2).reshape(*lead, -1)


def inference_layer_shapes(config: LLaDA2Config, layer: int) -> dict[str, tuple[int, ...]]:
    """One layer's parameters in the inference layout."""
    shapes = attention_shapes(config)
    d, i, e, im = config.hidden_size, config.intermediate_size, config.num_experts, config.moe_intermediate_size
    if layer < config.first_k_dense_replace:
        shapes |= {"gate_up_proj": (d, 2 * i), "down_proj": (i, d)}
    else:
        shapes |= {"router": (d, e), "expert_bias": (e,), "experts_gate_up": (e, d, 2 * im),
                   "experts_down": (e, im, d)}
    if config.num_shared_experts and layer >= config.first_k_dense_replace:
        s = config.num_shared_experts * im
        shapes |= {"shared_gate_up": (d, 2 * s), "shared_down": (s, d)}
    return quantized_inference_shapes(shapes, QUANTIZED_INFERENCE) if config.quantize else shapes


def prepare_layer(config: LLaDA2Config, layer: int, attn: dict, mlp: dict) -> dict:
    """One layer's inference dict from its checkpoint-layout slices `attn` and `mlp` (dense or MoE)."""
    p = dict(attn)
    for name in ("qkv_proj", "qkv_bias", scale_name("qkv_proj")):  # a quantized weight's scales: its columns
        if name in p:
            p[name] = group_qkv(p[name], config)
    suffixes = ("", SCALE) if config.quantize else ("",)
    if layer < config.first_k_dense_replace:
        for x in suffixes:
            p |= {"gate_up_proj" + x: interleave(mlp["gate_proj" + x], mlp["up_proj" + x]),
                  "down_proj" + x: mlp["down_proj" + x]}
        return transpose_quantized(p)
    p |= {"router": mlp["router"], "expert_bias": mlp["expert_bias"]}
    for x in suffixes:
        p |= {"experts_gate_up" + x: interleave(mlp["gate_proj" + x], mlp["up_proj" + x]),
              "experts_down" + x: mlp["down_proj" + x]}
    if config.num_shared_experts:
        for x in suffixes:
            p |= {"shared_gate_up" + x: interleave(mlp["shared_gate_proj" + x], mlp["shared_up_proj" + x]),
                  "shared_down" + x: mlp["shared_down_proj" + x]}
    return transpose_quantized(p)


def prepare_params(params: dict, config: LLaDA2Config, *, execution: str = "unrolled") -> dict:
    """The checkpoint layout -> the inference layout (a tree already in it is returned as is). Takes
    ownership: `params` is emptied as its tensors move (each stacked tensor is dropped once sliced)."""
    if execution != "unrolled":
        raise ValueError(f"LLaDA2 runs its layers unrolled (dense and MoE layers differ), got execution={execution!r}")
    if isinstance(params.get("layers"), tuple):
        return dict(params)
    attn, dense, moe = params.pop("layers"), params.pop("dense", {}), params.pop("moe", {})
    layers = []
    for layer in range(config.num_layers):
        mlp_tree, index = (dense, layer) if layer < config.first_k_dense_replace else (
            moe, layer - config.first_k_dense_replace)
        layers.append(prepare_layer(config, layer, {n: w[layer] for n, w in attn.items()},
                                    {n: w[index] for n, w in mlp_tree.items()}))
    attn.clear(), dense.clear(), moe.clear()
    return transpose_quantized({name: params.pop(name) for name in list(params)}) | {"layers": tuple(layers)}


def to_module_tree(params: dict) -> dict:
    """The inference tree -> nnx's pure dict (what `nnx.replace_by_pure_dict` takes)."""
    return dict(params, layers=dict(enumerate(params["layers"])))


# --- the forward pass ----------------------------------------------------------------------------

def route(x, router, expert_bias, config: LLaDA2Config):
    """(expert indices int32 [T, k], fp32 weights [T, k]) of tokens x [T, d] (official LLaDA2MoeGate)."""
    t, e, g = x.shape[0], config.num_experts, config.n_group
    logits = jnp.matmul(x.astype(jnp.float32), router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    scores = jax.nn.sigmoid(logits)
    biased = scores + expert_bias.astype(jnp.float32)
    group_scores = jnp.sum(jax.lax.top_k(biased.reshape(t, g, e // g), 2)[0], axis=-1)  # [T, G]
    _, groups = jax.lax.top_k(group_scores, config.topk_group)
    kept = jnp.any(groups[:, :, None] == jnp.arange(g), axis=1)  # [T, G]
    masked = jnp.where(jnp.repeat(kept, e // g, axis=1), biased, -jnp.inf)
    _, idx = jax.lax.top_k(masked, config.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, idx, axis=1)
    if config.num_experts_per_tok > 1:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return idx.astype(jnp.int32), weights * config.routed_scaling_factor


def shared_experts(p, x):
    """The shared experts' SwiGLU of x [T, d] (their gate/up and down weights, quantized or not)."""
    both = linear(x, p, "shared_gate_up", precision=matmul_precision(x.dtype))
    return linear(swiglu_gate(both), p, "shared_down", precision=matmul_precision(x.dtype))


def moe_sublayer(p, x, config: LLaDA2Config):
    """x + routed experts + shared experts of mlp_norm(x) (official LLaDA2MoeSparseMoeBlock)."""
    b, n, d = x.shape
    h = rms_norm(x, p["mlp_norm"], config.rms_norm_eps).reshape(b * n, d)
    idx, weights = route(h, p["router"], p["expert_bias"], config)
    # in generation on a model loaded with mesh=, the experts run per device
    out = routed_experts(h, idx, weights, p["experts_gate_up"], p["experts_down"], mesh=traced_mesh(),
                         gate_up_scale=p.get(scale_name("experts_gate_up")),
                         down_scale=p.get(scale_name("experts_down"))).astype(x.dtype)
    if config.num_shared_experts:
        out = out + shared_experts(p, h)
    return x + out.reshape(b, n, d)


def decoder_stack(layers: tuple, x, cos, sin, attend, config: LLaDA2Config, state=()):
    """All layers (inference layout) over x [B, L, d]; returns (x, state), `state` threaded through
    every layer's `attend` call."""
    for index, p in enumerate(layers):
        x, state = attention_sublayer(p, x, cos, sin, attend, state, index, config)
        if index < config.first_k_dense_replace:
            x = mlp_sublayer(p, x, eps=config.rms_norm_eps)
        else:
            x = moe_sublayer(p, x, config)
    return x, state


def tables(positions, config: LLaDA2Config):
    return rope_tables(positions, config.rotary_dim, config.rope_theta)


def inference(params, config: LLaDA2Config) -> dict:
    """params in the inference layout (prepared on the fly from the checkpoint layout: for tests)."""
    return params if isinstance(params["layers"], tuple) else prepare_params(dict(params), config)


DECODER = BlockDecoder(decoder_stack=decoder_stack, rope_tables=tables, full_params=inference, cached_params=inference)


def forward(params, input_ids, policy_state=None, step=0, *, config: LLaDA2Config, block_length: int | None = None,
            policy: AttentionPolicy = Dense()):
    """Full-sequence forward under the block-causal mask: int32 [B, L] -> (float32 logits [B, L, V],
    policy_state). The last block may be partial; `dllm_jax.models.block_diffusion.forward` with this family's DECODER."""
    return block_diffusion.forward(params, input_ids, policy_state, step, config=config, block_length=block_length,
                        policy=policy, decoder=DECODER)


def prefill(params, input_ids, cache: KVCache, lengths=None, *, config: LLaDA2Config, block_length: int | None = None,
            policy: AttentionPolicy = Dense(), chunk_tokens: int = block_diffusion.PREFILL_TOKENS,
            begin=0) -> KVCache:
    """Writes the K/V of the complete prompt blocks input_ids [B, P] at positions 0..P-1 and sets the
    fill lengths to `lengths` (default P); `dllm_jax.models.block_diffusion.prefill` (dense, exact, in chunks)
    with this family's DECODER."""
    return block_diffusion.prefill(params, input_ids, cache, lengths, config=config, block_length=block_length, policy=policy,
                        decoder=DECODER, chunk_tokens=chunk_tokens, begin=begin)


def cached_forward(params, segments: tuple, cache: KVCache, policy_state, *, config: LLaDA2Config,
                   policy: AttentionPolicy):
    """One forward of the concatenated segments against the cache; `dllm_jax.models.block_diffusion.cached_forward`
    with this family's DECODER."""
    return block_diffusion.cached_forward(params, segments, cache, policy_state, config=config, policy=policy, decoder=DECODER)


def block_step(params, block_ids, cache: KVCache, policy_state=None, mode=None, *, config: LLaDA2Config,
               policy: AttentionPolicy = Dense(), commit=False):
    """One block block_ids [B, n] at positions length[b].. against the cache; with commit=True the fill
    length advances by n. Returns (float32 logits [B, n, V], cache, policy_state);
    `dllm_jax.models.block_diffusion.block_step` with this family's DECODER."""
    return block_diffusion.block_step(params, block_ids, cache, policy_state, mode, config=config, policy=policy, commit=commit,
                           decoder=DECODER)


def commit_and_step(params, finished_ids, pending, block_ids, cache: KVCache, policy_state, finished_mode, mode, *,
                    config: LLaDA2Config, policy: AttentionPolicy = Dense()):
    """The commit of a finished block (rows where `pending`) and the next block's first step in one
    forward; exact under the block-causal mask (`dllm_jax.models.block_diffusion.commit_and_step` with this family's DECODER)."""
    return block_diffusion.commit_and_step(params, finished_ids, pending, block_ids, cache, policy_state, finished_mode, mode,
                                config=config, policy=policy, decoder=DECODER)


# --- the module ----------------------------------------------------------------------------------

def random_params(shapes: dict, *, dtype, rngs: nnx.Rngs, quantize: str | None = None) -> dict:
    """nnx.Params of `shapes`: norms 1, expert biases 0.1 * normal, other weights normal(0.02) (quantized
    where `shapes` holds their `<name>_scale`, as `layers.layer_params`)."""
    expert_bias = {name: shape for name, shape in shapes.items() if name == "expert_bias"}
    params = layer_params({n: s for n, s in shapes.items() if n not in expert_bias}, dtype=dtype, rngs=rngs,
                          quantize=quantize)
    for name, shape in expert_bias.items():
        params[name] = nnx.Param((0.1 * jax.random.normal(rngs.params(), shape)).astype(dtype))
    return params


class LLaDA2Layer(nnx.Module):
    """One layer's parameters in the inference layout (dense or MoE by its index)."""

    def __init__(self, config: LLaDA2Config, layer: int, *, dtype, rngs: nnx.Rngs):
        self.names = tuple(inference_layer_shapes(config, layer))
        shapes = inference_layer_shapes(config, layer)
        for name, param in random_params(shapes, dtype=dtype, rngs=rngs, quantize=config.quantize).items():
            setattr(self, name, param)


class LLaDA2(BlockDiffusionLM):
    """LLaDA2 MoE block-diffusion LM. `model(input_ids)` is the full block-causal forward (block length
    from the config, 32); `init_cache`, `prefill`, `block_step` the cached path the sampler runs
    (`BlockDiffusionLM`); embedding, final norm and head as `DecoderLM`, layers dense or MoE by index."""

    decoder = DECODER

    def __init__(self, config: LLaDA2Config, *, dtype=jnp.bfloat16, rngs: nnx.Rngs, execution: str = "unrolled"):
        if execution != "unrolled":
            raise ValueError(f"LLaDA2 runs its layers unrolled, got execution={execution!r}")
        super().__init__(config, dtype=dtype, rngs=rngs, execution=execution)

    def make_layers(self, config: LLaDA2Config, *, dtype, rngs: nnx.Rngs):
        return nnx.List([LLaDA2Layer(config, i, dtype=dtype, rngs=rngs) for i in range(config.num_layers)])

    def layer_values(self) -> tuple:
        """The inference-layout layers as plain arrays (a tuple of per-layer dicts, each its own names)."""
        return tuple({name: getattr(layer, name).get_value() for name in layer.names} for layer in self.layers)
