"""Model surgery for warm starts: fresh parameters of a config, and functions that grow a trained model (more
layers, wider heads, regrouped heads) while computing the same function (`python -m dllm_jax.train --grow-layers /
--widen-heads / --regroup-heads`)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.checkpoint.orbax import tree_paths
from dllm_jax.config import LLaDAConfig, SDARConfig
from dllm_jax.models.layers import lm_param_shapes
from dllm_jax.validation import integer


def init_params(config: LLaDAConfig | SDARConfig, key) -> dict:
    """Fresh float32 parameters in the checkpoint layout: norms 1, every other weight N(0, 0.02²)
    (logits start near 0, so the loss starts near log(vocab_size))."""
    shapes = lm_param_shapes(config)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    paths = list(tree_paths(shapes, is_leaf=lambda x: isinstance(x, tuple)))
    keys = jax.random.split(key, len(leaves))
    values = [jnp.ones(shape, jnp.float32) if path.endswith("norm") else 0.02 * jax.random.normal(k, shape)
              for path, shape, k in zip(paths, leaves, keys)]
    return jax.tree.unflatten(treedef, values)


RESIDUAL_OUTPUTS = ("o_proj", "down_proj")  # what a layer adds to the residual stream goes through these


def grow_layers(params: dict, num_layers: int) -> dict:
    """Checkpoint-layout `params` deepened to `num_layers` decoder layers (a multiple of the current n):
    each trained layer is followed by num_layers / n - 1 copies of itself whose output projections
    (`RESIDUAL_OUTPUTS`) are zero. A zero-output layer adds nothing to the residual stream, so the grown
    model computes exactly what the trained one did, and training starts from there with the copies'
    attention and MLP weights already meaningful (zero-initialised residual branches, as in ReZero and
    progressive stacking). Returns new float32 arrays; ValueError for a depth that is not a multiple."""
    layers = params["layers"]
    n = int(np.shape(layers["o_proj"])[0])
    num_layers = integer("num_layers", num_layers)
    if num_layers % n:
        raise ValueError(f"grow_layers: {num_layers} layers is not a multiple of the model's {n}")
    copies = num_layers // n
    order = np.repeat(np.arange(n), copies)  # layer i, then its copies
    trained = np.arange(num_layers) % copies == 0
    grown = {}
    for name, value in layers.items():
        value = jnp.asarray(value, jnp.float32)[order]
        if name in RESIDUAL_OUTPUTS:
            value = value * jnp.asarray(trained, jnp.float32).reshape((-1,) + (1,) * (value.ndim - 1))
        grown[name] = value
    return {**params, "layers": grown}


def widen_heads(params: dict, config, head_dim: int) -> dict:
    """Checkpoint-layout `params` of a model with a head_dim field (SDAR) widened to `head_dim` (a
    multiple f of the current), computing what the trained model did: old dimension j of each half of
    a head moves to f·j of that half, where half-rotation RoPE gives it the same frequency
    (theta^(-2j/D) = theta^(-2fj/fD)); the new dimensions start at zero (zero query, key, value and
    output weights, zero q/k norm weights). The logit scale 1/sqrt(head_dim) falls by sqrt(f), and the
    q/k RMSNorm statistics, taken over f times the dimensions, grow the normalised values by sqrt(f) (up
    to the norm's eps): the key norm weights divided by sqrt(f) make up for both. This is how the trained
    32-wide heads become the 64- or 128-wide heads the Hopper kernels take. Returns new float32 arrays;
    ValueError for a width that is not a multiple, or a model without a head_dim field and q/k norms."""
    if "head_dim" not in {f.name for f in dataclasses.fields(config)} or not config.qk_norm:
        raise ValueError(f"{type(config).__name__}: widen_heads needs a head_dim field (LLaDA's is hidden_size / "
                         "num_heads) and q/k RMSNorm (SDAR)")
    old = config.head_dim
    head_dim = integer("head_dim", head_dim)
    if head_dim % old:
        raise ValueError(f"widen_heads: head_dim {head_dim} is not a multiple of the model's {old}")
    f, half = head_dim // old, old // 2
    index = np.concatenate([f * np.arange(half), f * np.arange(half) + head_dim // 2])  # new place of each old dim
    gain = {"k_norm": f ** -0.5}
    axis = {"q_proj": 3, "k_proj": 3, "v_proj": 3, "q_bias": 2, "k_bias": 2, "v_bias": 2, "o_proj": 2,
            "q_norm": 1, "k_norm": 1}
    layers = {}
    for name, value in params["layers"].items():
        value = jnp.asarray(value, jnp.float32)
        if name in axis:
            shape = list(value.shape)
            shape[axis[name]] = head_dim
            at = (slice(None),) * axis[name] + (index,)
            value = jnp.zeros(shape, jnp.float32).at[at].set(value * gain.get(name, 1.0))
        layers[name] = value
    return {**params, "layers": layers}


def regroup_heads(params: dict, config, num_heads: int) -> dict:
    """Checkpoint-layout `params` with each group of f = config.num_heads / `num_heads` query heads (and f
    KV heads) merged into one f times wider head, the hidden size unchanged: the only way to widen the heads
    of a model whose head_dim is hidden_size / num_heads (LLaDA). Lossy by construction, a warm start to
    train on: a merged head takes one softmax over the sum of its members' logits, and its members' values
    share that softmax. Member r of a group takes dimensions f·j + r of each RoPE half, so member 0 keeps
    its frequencies exactly (theta^(-2j/D) = theta^(-2fj/fD)) and the others' shift by under one old step.
    The query weights gain sqrt(f) for the 1/sqrt(head_dim) scale. Member r of query head h (KV group
    c = h // G, G query heads per KV head) is the old query head (f·c + r)·G + h % G, whose KV head is the
    old f·c + r: member r of the new KV head c, so each old query still meets its own keys. Returns new
    float32 arrays; ValueError for a head count that does not divide both head counts."""
    if config.qk_norm:
        raise ValueError(f"{type(config).__name__}: regroup_heads takes models without q/k norms (LLaDA); widen "
                         "an SDAR's heads with widen_heads")
    old_heads, old_kv = config.num_heads, config.num_kv_heads
    num_heads = integer("num_heads", num_heads)
    if old_heads % num_heads or old_kv % (old_heads // num_heads):
        raise ValueError(f"regroup_heads: {num_heads} heads do not divide the model's {old_heads} query and "
                         f"{old_kv} KV heads by one factor")
    f, group, dim = old_heads // num_heads, old_heads // old_kv, config.head_dim
    half = dim // 2
    index = np.concatenate([f * np.arange(half), f * np.arange(half) + f * half])  # member 0's new dimensions
    new_kv = old_kv // f
    q_members = [[(f * (h // group) + r) * group + h % group for r in range(f)] for h in range(num_heads)]
    kv_members = [[f * c + r for r in range(f)] for c in range(new_kv)]

    def merge(value, head_axis, members, gain=1.0):
        value = jnp.asarray(value, jnp.float32) * gain
        shape = list(value.shape)
        shape[head_axis], shape[head_axis + 1] = len(members), f * dim
        out = jnp.zeros(shape, jnp.float32)
        lead = (slice(None),) * head_axis
        for new, olds in enumerate(members):
            for r, old in enumerate(olds):
                out = out.at[lead + (new, index + r)].set(value[lead + (old,)])
        return out

    heads = {"q_proj": (2, q_members, f ** 0.5), "q_bias": (1, q_members, f ** 0.5), "o_proj": (1, q_members, 1.0),
             "k_proj": (2, kv_members, 1.0), "v_proj": (2, kv_members, 1.0), "k_bias": (1, kv_members, 1.0),
             "v_bias": (1, kv_members, 1.0)}
    layers = {name: merge(value, *heads[name]) if name in heads else jnp.asarray(value, jnp.float32)
              for name, value in params["layers"].items()}
    return {**params, "layers": layers}


def check_param_shapes(params: dict, model) -> None:
    """ValueError listing every tensor missing, unexpected or mis-shaped for the checkpoint layout of `model`."""
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    expected = tree_paths(lm_param_shapes(model), is_leaf=is_shape)
    found = {path: tuple(np.shape(x)) for path, x in tree_paths(params).items()}
    problems = [f"{p}: missing" for p in expected if p not in found]
    problems += [f"{p}: unexpected" for p in found if p not in expected]
    problems += [f"{p}: shape {list(found[p])}, expected {list(s)}" for p, s in expected.items()
                 if p in found and found[p] != s]
    if problems:
        raise ValueError("params do not fit the model config in the checkpoint layout (stacked layers, "
                         "dllm_jax.models.layers.lm_param_shapes):\n  " + "\n  ".join(problems))
