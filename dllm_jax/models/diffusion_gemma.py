"""DiffusionGemma's text model in pure JAX: a Gemma-4 stack that encodes a prompt into a KV cache and
denoises a canvas against it (transformers' `DiffusionGemmaForBlockDiffusion`).

One set of weights runs twice:
  * the encoder: causal over the prompt (sliding layers see their last `sliding_window` positions),
    its keys and values written into a static-shaped `KVCache`; its hidden states are not needed
    (the last layer's feed-forward and the final norm are skipped);
  * the decoder: bidirectional over a canvas of tokens placed just after the prompt, attending to the
    cached prefix and to itself. Its sliding layers see the last sliding_window - 1 cached positions
    (what transformers' sliding cache keeps) and the whole canvas; its global layers see all of it.
    The canvas input is the RMS-normalized sum of its scaled embeddings and a self-conditioning signal:
    a gated MLP of the softmax of the previous step's logits, as soft embeddings (zero on the first step).
Each layer (both stacks): attention with per-head RMSNorm on queries and keys, a scale-free RMSNorm on
values and no 1/sqrt(D) (the norms set the logit scale); on global layers no value projection (values
are the keys before k_norm and RoPE), a larger head_dim, fewer KV heads and proportional RoPE. Then a
dense GELU MLP beside a routed-experts MLP (router on the raw residual, its own RMSNorm on the experts'
input), each post-normed, summed, normed again and added to the residual; the layer's output is scaled
by its `layer_scalar`. Logits: the tied embedding, soft-capped by tanh at `final_logit_softcapping`.

The cache (`dllm_jax.models.block_diffusion.KVCache`): one [B, max_length, K_l, D_l] key and value
buffer per layer l (sliding and global layers differ in K and D) and an int32 fill length per row.
`encode` appends tokens at each row's fill length and advances it; `decode` writes the canvas's keys
and values into the slots just past the fill length (scratch: the filled prefix and the length are
left as they were) and attends over the buffer, so max_length must hold the longest row plus the canvas. A sliding
layer reads only its window of the buffer (`sliding_view`: the window - 1 positions before the new tokens and
theirs), so its cost does not grow with the prompt; global layers read the whole buffer under a mask, or with
MAGE (`decode_mage`) a selection of k cached positions per KV head, chosen at a canvas's first step.
Parameters: `dllm_jax.models.diffusion_gemma_weights` (the checkpoint layout and the inference tree these
functions read). `DiffusionGemma` is the registry's model (`dllm_jax.load_model`): the inference tree as nnx
parameters, called as transformers' forward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dllm_jax.attention import mage
from dllm_jax.attention.dense import dense_attention, matmul_precision
from dllm_jax.diffusion_gemma_config import DiffusionGemmaConfig, RopeConfig
from dllm_jax.models import moe
from dllm_jax.models.block_diffusion import KVCache, replace_layer, write_rows
from dllm_jax.models.diffusion_gemma_weights import inference_shapes
from dllm_jax.models.layers import apply_rope, check_inputs
from dllm_jax.quantize import linear, scale_name

__all__ = ["DiffusionGemma", "DiffusionGemmaConfig", "KVCache", "init_cache", "init_selection", "encode", "decode",
           "decode_mage", "forward"]


# --- pieces ----------------------------------------------------------------------------------------

def norm(x, weight, eps: float):
    """Gemma-4 RMSNorm: x / sqrt(mean(x^2) + eps) in fp32, times `weight` (None: no scale), in x's dtype."""
    xf = x.astype(jnp.float32)
    out = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (out if weight is None else out * weight.astype(jnp.float32)).astype(x.dtype)


def dot(x, w):
    return jnp.matmul(x, w, precision=matmul_precision(x.dtype))


def project(x, p: dict, name: str):
    """x @ p[name]: a full-precision or a quantized weight (`dllm_jax.quantize.linear`)."""
    return linear(x, p, name, precision=matmul_precision(x.dtype))


def gelu_gate(both, config: DiffusionGemmaConfig):
    """gelu(gate) * up of interleaved columns [..., 2n] (`diffusion_gemma_weights`)."""
    return jax.nn.gelu(both[..., 0::2], approximate=config.gelu_tanh) * both[..., 1::2]


def gated_mlp(x, p: dict, config: DiffusionGemmaConfig):
    """The GELU-gated MLP of p's gate_up_proj and down_proj."""
    return project(gelu_gate(project(x, p, "gate_up_proj"), config), p, "down_proj")


def inv_frequencies(rope: RopeConfig) -> np.ndarray:
    """fp32 [head_dim / 2]: the rotated frequencies (exponents over the whole head_dim, as transformers computes
    them in fp32), then zeros (pairs left unrotated: proportional RoPE)."""
    exponents = np.arange(0, 2 * rope.rotated, 2, dtype=np.float32) / np.float32(rope.head_dim)
    rotated = np.float32(1.0) / np.power(np.float32(rope.theta), exponents) / np.float32(rope.factor)
    return np.concatenate([rotated, np.zeros(rope.head_dim // 2 - rope.rotated, np.float32)])


def rope_tables(positions, rope: RopeConfig):
    """fp32 cos / sin [..., head_dim] at integer `positions` (half rotation)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_frequencies(rope))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def embed(params, ids):
    """Scaled token embeddings; the scale sqrt(d) is rounded to the weights' dtype first, as transformers does."""
    table = params["embed"]
    return table[ids] * jnp.asarray(table.shape[1] ** 0.5, table.dtype)


# --- one layer ---------------------------------------------------------------------------------------

def attention_sublayer(p, x, tables, attend, state, layer: int, config: DiffusionGemmaConfig):
    """(x + post_attn_norm(o_proj(attend(q, k, v))) of the pre-normed x, state); `attend(q, k, v, state, layer)
    -> (out, state)` is the pass's attention with its cache writes, the cache threaded through as `state`."""
    eps, (cos, sin) = config.rms_norm_eps, tables
    b, n, _ = x.shape
    hd = config.head_dims[layer]
    h = norm(x, p["attn_norm"], eps)
    q = norm(project(h, p, "q_proj").reshape(b, n, config.num_heads, hd), p["q_norm"], eps)
    raw_k = project(h, p, "k_proj").reshape(b, n, -1, hd)
    raw_v = project(h, p, "v_proj").reshape(b, n, -1, hd) if config.is_sliding(layer) else raw_k
    k = norm(raw_k, p["k_norm"], eps)
    q, k = apply_rope(q, cos, sin, in_fp32=False), apply_rope(k, cos, sin, in_fp32=False)
    with jax.named_scope("attention"):
        out, state = attend(q, k, norm(raw_v, None, eps), state, layer)
    return x + norm(project(out.reshape(b, n, -1), p, "o_proj"), p["post_attn_norm"], eps), state


def route(p, x, config: DiffusionGemmaConfig):
    """(weights fp32 [T, k], experts int32 [T, k]) of tokens x [T, d]: softmax over all experts of the
    scaled, scale-free-normed x, the top k renormalized to sum 1, then times each expert's own scale."""
    h = norm(x, None, config.rms_norm_eps) * p["router_norm"] * jnp.asarray(config.hidden_size ** -0.5, x.dtype)
    probs = jax.nn.softmax(dot(h, p["router"]).astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, config.top_k_experts)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights * p["expert_scale"][experts].astype(jnp.float32), experts.astype(jnp.int32)


def routed_experts(x, experts, weights, p: dict, config: DiffusionGemmaConfig, backend: str):
    """sum_j weights[:, j] * expert_{experts[:, j]}(x) for x [T, d]: `dllm_jax.models.moe.routed_experts` with
    Gemma's GELU gate, of p's experts_gate_up and experts_down (quantized ones with their scales)."""
    return moe.routed_experts(x, experts, weights, p["experts_gate_up"], p["experts_down"],
                              gate_up_scale=p.get(scale_name("experts_gate_up")),
                              down_scale=p.get(scale_name("experts_down")), backend=backend,
                              gate=functools.partial(gelu_gate, config=config)).astype(x.dtype)


def feed_forward_sublayer(p, x, config: DiffusionGemmaConfig, backend: str):
    """x + post_ffw_norm(dense MLP + routed experts), each branch with its own pre and post norms."""
    eps = config.rms_norm_eps
    dense = norm(gated_mlp(norm(x, p["mlp_norm"], eps), p, config), p["post_mlp_norm"], eps)
    flat = x.reshape(-1, x.shape[-1])
    weights, experts = route(p, flat, config)
    routed = routed_experts(norm(flat, p["moe_norm"], eps), experts, weights, p, config, backend)
    routed = norm(routed.reshape(x.shape), p["post_moe_norm"], eps)
    return x + norm(dense + routed, p["post_ffw_norm"], eps)


def run_stack(params, x, positions, attend, state, scalar: str, config: DiffusionGemmaConfig, backend: str, *,
              last_feed_forward: bool = True):
    """(x, state) after all layers over x [B, n, d] at positions int32 [B, n], `state` threaded through every
    layer's `attend`; `scalar` names the stack's layer_scalar."""
    tables = {kind: rope_tables(positions, rope) for kind, rope in config.rope}
    for layer, p in enumerate(params["layers"]):
        x, state = attention_sublayer(p, x, tables[config.layer_types[layer]], attend, state, layer, config)
        if last_feed_forward or layer < config.num_layers - 1:
            x = feed_forward_sublayer(p, x, config, backend)
        x = x * p[scalar].astype(x.dtype)
    return x, state


# --- the cache and the two passes --------------------------------------------------------------------------

def init_cache(config: DiffusionGemmaConfig, batch: int, max_length: int, dtype=jnp.float32) -> KVCache:
    """An empty cache: per layer [batch, max_length, K_l, D_l] keys and values, fill lengths 0."""
    shapes = [(batch, max_length, kv, hd) for kv, hd in zip(config.kv_heads, config.head_dims)]
    return KVCache(tuple(jnp.zeros(s, dtype) for s in shapes), tuple(jnp.zeros(s, dtype) for s in shapes),
                   jnp.zeros((batch,), jnp.int32))


def write_layer(cache: KVCache, layer: int, k, v, start) -> KVCache:
    """cache with k / v [B, n, K, D] written at each row's slots start[b].."""
    return cache.replace(k=replace_layer(cache.k, layer, write_rows(cache.k[layer], k, start)),
                         v=replace_layer(cache.v, layer, write_rows(cache.v[layer], v, start)))


def sliding_view(cache: KVCache, layer: int, start, n: int, window: int):
    """(keys, values [B, size, K, D], their positions int32 [B, size]) of what a sliding layer's queries at
    start..start+n-1 may see: the `window` - 1 positions before start and the n from it, a slice of each row's
    buffer (size = window - 1 + n, or the whole buffer where that is not shorter), so a sliding layer reads its
    window, not the whole cache."""
    max_length = cache.max_length
    size = min(window - 1 + n, max_length)
    low = jnp.clip(start - (window - 1), 0, max_length - size)
    take = jax.vmap(lambda buffer, first: jax.lax.dynamic_slice_in_dim(buffer, first, size, axis=0))
    return take(cache.k[layer], low), take(cache.v[layer], low), low[:, None] + jnp.arange(size, dtype=jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "backend"))
def encode(params, input_ids, cache: KVCache, lengths=None, *, config: DiffusionGemmaConfig,
           backend: str = "auto") -> KVCache:
    """Appends the prompt tokens input_ids [B, n] to the cache at each row's fill length (causal attention to
    the row's cached positions and to the tokens before them; sliding layers within their window) and
    advances the fill lengths by `lengths` (int32 [B], the real tokens of right-padded rows; default n). Jitted."""
    b, n = input_ids.shape
    start = cache.length
    positions = start[:, None] + jnp.arange(n, dtype=jnp.int32)  # [B, n]
    every = jnp.broadcast_to(jnp.arange(cache.max_length, dtype=jnp.int32), (b, cache.max_length))

    def attend(q, k, v, cache: KVCache, layer: int):
        cache = write_layer(cache, layer, k, v, start)
        if config.is_sliding(layer):
            keys, values, seen = sliding_view(cache, layer, start, n, config.sliding_window)
            window = positions[:, :, None] - seen[:, None, :] < config.sliding_window
        else:
            keys, values, seen, window = cache.k[layer], cache.v[layer], every, True
        mask = (seen[:, None, :] <= positions[:, :, None]) & window  # causal [B, n, keys]
        return dense_attention(q, keys, values, mask=mask, scale=1.0, backend=backend), cache

    _, cache = run_stack(params, embed(params, input_ids), positions, attend, cache, "encoder_scalar", config, backend,
                         last_feed_forward=False)  # only the keys and values are kept
    added = jnp.full((b,), n, jnp.int32) if lengths is None else jnp.asarray(lengths, jnp.int32)
    return cache.replace(length=start + added)


def self_condition(p, x, previous_logits, table, config: DiffusionGemmaConfig, conditioned=None):
    """norm(x + MLP(pre_norm(soft embeddings of previous_logits [B, C, V]))) without a scale; None: the first
    step, whose zero signal leaves norm(x) (MLP(0) = 0). Rows where `conditioned` (bool, scalar or [B]) is
    False get that zero signal too (transformers' self_conditioning_mask)."""
    eps = config.rms_norm_eps
    if previous_logits is None:
        return norm(x, None, eps)
    probs = jax.nn.softmax(previous_logits.astype(jnp.float32), axis=-1).astype(table.dtype)
    soft = dot(probs, table) * jnp.asarray(table.shape[1] ** 0.5, table.dtype)
    if conditioned is not None:
        soft = soft * jnp.reshape(jnp.asarray(conditioned), (-1, 1, 1)).astype(soft.dtype)
    return norm(x + gated_mlp(norm(soft, p["pre_norm"], eps), p, config), None, eps)


@struct.dataclass
class CanvasState:
    """What a canvas pass threads through its layers: the cache, and the selection each sparse layer made
    ({layer: int32 [B, K_l, k]}, `decode_mage`)."""

    cache: KVCache
    selection: dict


def sparse_layers(config: DiffusionGemmaConfig, method) -> tuple[int, ...]:
    """The layers whose canvas attends to a selection of the cached prefix under `method` (a `MAGE`; None: none):
    the global layers from its `exact_layers` on (a sliding layer reads its window, already short)."""
    if method is None:
        return ()
    return tuple(layer for layer in range(config.num_layers)
                 if not config.is_sliding(layer) and layer >= method.exact_layers)


def init_selection(config: DiffusionGemmaConfig, method, batch: int) -> dict:
    """An empty selection of `method` (a MAGE): {layer: int32 zeros [batch, K_l, k]} over its `sparse_layers`, the
    shape a loop carries before a canvas's first step selects."""
    return {layer: jnp.zeros((batch, config.kv_heads[layer], method.k), jnp.int32)
            for layer in sparse_layers(config, method)}


def canvas_pass(params, canvas_ids, cache: KVCache, self_conditioning_logits, selection, *,
                config: DiffusionGemmaConfig, backend: str, conditioned, method, select):
    """(logits, cache, selection) of `decode` (method None) or `decode_mage`."""
    b, c = canvas_ids.shape
    start = cache.length
    positions = start[:, None] + jnp.arange(c, dtype=jnp.int32)
    every = jnp.broadcast_to(jnp.arange(cache.max_length, dtype=jnp.int32), (b, cache.max_length))
    sparse = sparse_layers(config, method)

    def attend(q, k, v, state: CanvasState, layer: int):
        cache = write_layer(state.cache, layer, k, v, start)
        if config.is_sliding(layer):
            # transformers' sliding cache keeps the last sliding_window - 1 prompt positions; the canvas sees them all
            keys, values, seen = sliding_view(cache, layer, start, c, config.sliding_window)
            key_mask = (seen >= (start - (config.sliding_window - 1))[:, None]) & (seen < (start + c)[:, None])
            out = dense_attention(q, keys, values, key_mask=key_mask, scale=1.0, backend=backend)
            return out, state.replace(cache=cache)
        keys, values, key_mask = cache.k[layer], cache.v[layer], every < (start + c)[:, None]

        def exact():
            return dense_attention(q, keys, values, key_mask=key_mask, scale=1.0, backend=backend)

        if layer not in sparse:
            return exact(), state.replace(cache=cache)

        def exact_and_select():  # the paper's Eq. 3 over the canvas's queries; no kernel takes 512-wide heads
            scores = mage.canvas_prefix_scores(q, keys, start, scale=1.0, softmax_over=method.softmax_over)
            return exact(), mage.ranked_selection(scores, start, k=method.k, select_by=method.select_by)

        def selected():
            out = mage.canvas_attention(q, k, v, keys, values, selection[layer], start, scale=1.0, backend=backend)
            return out, selection[layer]

        if isinstance(select, bool):
            out, chosen = exact_and_select() if select else selected()
        else:  # one step of a loop: only this layer's attention is traced twice, not the whole decoder
            out, chosen = jax.lax.cond(select, exact_and_select, selected)
        return out, CanvasState(cache=cache, selection=state.selection | {layer: chosen})

    x = self_condition(params["self_conditioning"], embed(params, canvas_ids), self_conditioning_logits,
                       params["embed"], config, conditioned)
    x, state = run_stack(params, x, positions, attend, CanvasState(cache=cache, selection={}), "decoder_scalar",
                         config, backend)
    x = norm(x, params["final_norm"], config.rms_norm_eps)
    logits = jnp.matmul(x, params["embed"].T, precision=matmul_precision(x.dtype)).astype(jnp.float32)
    cap = config.final_logit_softcapping
    return jnp.tanh(logits / cap) * cap, state.cache, state.selection


@functools.partial(jax.jit, static_argnames=("config", "backend"))
def decode(params, canvas_ids, cache: KVCache, self_conditioning_logits=None, *, config: DiffusionGemmaConfig,
           backend: str = "auto", conditioned=None):
    """(float32 logits [B, C, V], cache) of the canvas canvas_ids [B, C] placed at each row's fill length,
    attending bidirectionally to the cached prefix and to itself, self-conditioned on the previous step's
    logits [B, C, V] where given and `conditioned` (bool, scalar or [B], traced: a loop's first step passes
    False) is not False. The returned cache holds the canvas's keys and values in its scratch slots; its
    filled prefix and lengths are unchanged. Jitted."""
    logits, cache, _ = canvas_pass(params, canvas_ids, cache, self_conditioning_logits, None, config=config,
                                   backend=backend, conditioned=conditioned, method=None, select=True)
    return logits, cache


@functools.partial(jax.jit, static_argnames=("config", "backend", "method"))
def decode_mage(params, canvas_ids, cache: KVCache, self_conditioning_logits=None, selection=None, *,
                config: DiffusionGemmaConfig, method, backend: str = "auto", conditioned=None, select=None):
    """`decode` with MAGE (`dllm_jax.attention.mage.MAGE`: its k, exact_layers, softmax_over and select_by) on the
    global layers' cached prefix (`sparse_layers`): (logits, cache, selection). Without `selection` every layer
    attends exactly and each sparse layer keeps the k prefix positions per KV head that the canvas's queries
    weigh most (the paper's Eq. 3: their softmax over the prefix, averaged over the KV head's query heads and the
    canvas); with one ({layer: int32 [B, K, k]}, what a call without one returned for the same prefix) the sparse
    layers attend to those positions and the canvas alone. `select` (a traced bool, with a selection: a loop's
    step) chooses between the two at run time, in each sparse layer. A prefix of at most k positions is kept
    whole (exact attention). Jitted."""
    select = selection is None if select is None else select
    selection = init_selection(config, method, canvas_ids.shape[0]) if selection is None else selection
    return canvas_pass(params, canvas_ids, cache, self_conditioning_logits, selection, config=config,
                       backend=backend, conditioned=conditioned, method=method, select=select)


def forward(params, input_ids, decoder_input_ids, self_conditioning_logits=None, *, config: DiffusionGemmaConfig,
            backend: str = "auto"):
    """float32 canvas logits [B, C, V] of the prompt input_ids [B, P] and canvas decoder_input_ids [B, C]
    (optionally conditioned on the previous step's logits [B, C, V]): what transformers'
    `DiffusionGemmaForBlockDiffusion(input_ids=..., decoder_input_ids=..., self_conditioning_logits=...)`
    returns as `logits`. Inputs are checked on the host; the two passes are the jitted `encode` and `decode`."""
    check_inputs(config, input_ids)
    check_inputs(config, decoder_input_ids, name="decoder_input_ids")
    if decoder_input_ids.shape[0] != input_ids.shape[0]:
        raise ValueError(f"decoder_input_ids has {decoder_input_ids.shape[0]} rows, input_ids {input_ids.shape[0]}")
    expected = (*decoder_input_ids.shape, config.vocab_size)
    if self_conditioning_logits is not None and tuple(self_conditioning_logits.shape) != expected:
        raise ValueError(f"self_conditioning_logits must be [batch, canvas, vocab] = {expected}, got "
                         f"{tuple(self_conditioning_logits.shape)}")
    b, p = input_ids.shape
    cache = init_cache(config, b, p + decoder_input_ids.shape[1], params["embed"].dtype)
    cache = encode(params, jnp.asarray(input_ids, jnp.int32), cache, config=config, backend=backend)
    return decode(params, jnp.asarray(decoder_input_ids, jnp.int32), cache, self_conditioning_logits, config=config,
                  backend=backend)[0]


# --- the registry's model ---------------------------------------------------------------------------------

class Weights(nnx.Module):
    """A dict of weights as nnx parameters (one attribute each), built zeroed from its shapes."""

    def __init__(self, shapes: dict):
        for name, shape in shapes.items():
            setattr(self, name, nnx.Param(jnp.zeros(shape.shape, shape.dtype)))

    def values(self) -> dict:
        return {name: value.get_value() for name, value in vars(self).items() if isinstance(value, nnx.Param)}


class DiffusionGemma(nnx.Module):
    """DiffusionGemma's text model around its inference tree (`dllm_jax.load_model` builds it from a checkpoint;
    `dllm_jax.generate` runs its sampler). `model(input_ids, decoder_input_ids, self_conditioning_logits=None)` is
    `forward`: float32 canvas logits [B, C, V], as transformers' forward returns them. `model.config` is its
    `DiffusionGemmaConfig`; `execution` is "unrolled" only (`prepare_params` refuses "scan")."""

    def __init__(self, config: DiffusionGemmaConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None,
                 execution: str = "unrolled"):
        del rngs  # the weights come from a checkpoint (`model_from_params`); nothing is drawn
        self.config, self.execution, self.mesh = config, execution, None
        shapes = inference_shapes(config, dtype)
        self.embed = nnx.Param(jnp.zeros(shapes["embed"].shape, dtype))
        self.final_norm = nnx.Param(jnp.zeros(shapes["final_norm"].shape, dtype))
        self.self_conditioning = Weights(shapes["self_conditioning"])
        self.layers = nnx.List([Weights(layer) for layer in shapes["layers"]])

    def params(self) -> dict:
        """The inference tree as plain arrays (`dllm_jax.models.diffusion_gemma_weights`)."""
        return dict(embed=self.embed.get_value(), final_norm=self.final_norm.get_value(),
                    self_conditioning=self.self_conditioning.values(),
                    layers=tuple(layer.values() for layer in self.layers))

    def __call__(self, input_ids, decoder_input_ids, self_conditioning_logits=None):
        return forward(self.params(), input_ids, decoder_input_ids, self_conditioning_logits, config=self.config)
