"""Random models for tests, the demo, the notebooks and the benchmarks: tiny configs, random weights
(one scheme, `random_weight`: as HF-format tensors on the host for checkpoints, or drawn on the device
for full-size models) and tiny checkpoints in a model's own HF format."""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dllm_jax.checkpoint.hf import (TARGET_DTYPES, Rule, hf_name, hf_shape, param_shapes_for,
                                    rules_for, tree_get)
from dllm_jax.checkpoint.hf_write import write_hf_files
from dllm_jax.config import DreamConfig, LLaDA2Config, LLaDAConfig, SDARConfig
from dllm_jax.diffusion_gemma_config import GLOBAL, SLIDING, DiffusionGemmaConfig, RopeConfig
from dllm_jax.families import family_of


def tiny_llada_config(**overrides) -> LLaDAConfig:
    """A small LLaDA config (2 layers, d=64, GQA 4:2) that runs in milliseconds on a CPU."""
    values = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                  vocab_size=160, tokenizer_vocab_size=150, rope_theta=500000.0, rms_norm_eps=1e-5,
                  max_position_embeddings=256, mask_token_id=140, eos_token_id=141, pad_token_id=141,
                  eot_token_id=142)
    return LLaDAConfig(**(values | overrides))


def tiny_sdar_config(**overrides) -> SDARConfig:
    """A small SDAR config (2 layers, d=64, 4 query / 2 kv heads of 32: head_dim * heads != d as in
    SDAR-4B, block size 4) that runs in milliseconds on a CPU."""
    values = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=96,
                  vocab_size=192, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=512,
                  block_size=4, mask_token_id=180, eos_token_ids=(181, 182), pad_token_id=182)
    return SDARConfig(**(values | overrides))


def tiny_dream_config(**overrides) -> DreamConfig:
    """A small Dream config (2 layers, d=64, GQA 4:2, q/k/v biases) that runs in milliseconds on a CPU."""
    values = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96,
                  vocab_size=176, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=512,
                  mask_token_id=170, eos_token_id=171, pad_token_id=171, bos_token_id=171)
    return DreamConfig(**(values | overrides))


def tiny_llada2_config(**overrides) -> LLaDA2Config:
    """A small LLaDA2 config (2 layers: the first dense, then MoE with 8 experts of width 24 in 2 groups,
    1 kept, top-2, a shared expert; d=64, GQA 4:2, qk-norm, half-rotary; block size 32): the 2-layer
    version of tests/test_llada2.py's TINY. Its HF tensors: `checkpoint.hf.llada2_expected` names them."""
    values = dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96,
                  moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, num_shared_experts=1, n_group=2,
                  topk_group=1, routed_scaling_factor=2.5, first_k_dense_replace=1, vocab_size=160,
                  rope_theta=600000.0, partial_rotary_factor=0.5, rms_norm_eps=1e-6, max_position_embeddings=512,
                  mask_token_id=150, eos_token_id=141, pad_token_id=141)
    return LLaDA2Config(**(values | overrides))


def tiny_diffusion_gemma_config(**overrides) -> DiffusionGemmaConfig:
    """A small DiffusionGemma config: a sliding layer (head_dim 16, 2 KV heads, window 4) and a global one
    (head_dim 32, 1 KV head, proportional RoPE over a quarter of its frequencies), 4 experts top-2 beside the dense
    MLP, d=64, canvases of 8 tokens. Its HF tensors: `hf_names.diffusion_gemma_expected` names them."""
    values = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_heads=4, layer_types=(SLIDING, GLOBAL),
                  head_dims=(16, 32), kv_heads=(2, 1), sliding_window=4,
                  rope=((SLIDING, RopeConfig(theta=10_000.0, head_dim=16, rotated=8)),
                        (GLOBAL, RopeConfig(theta=1_000_000.0, head_dim=32, rotated=4))),
                  num_experts=4, top_k_experts=2, moe_intermediate_size=32, canvas_length=8,
                  max_position_embeddings=512, eos_token_ids=(141,), pad_token_id=0)
    return DiffusionGemmaConfig(**(values | overrides))


def random_weight(z, rule: Rule, hf_tensor_shape: tuple[int, ...]):
    """The random-weight scheme of every random model here (`leaf_weight`) for the tensor of `rule`,
    whose fan-in is the last axis of its HF tensor."""
    return leaf_weight(z, rule.path[-1], hf_tensor_shape[-1])


def leaf_weight(z, name: str, fan_in: int):
    """A standard-normal draw z (numpy or JAX) made into the weight of parameter leaf `name`: projections
    N(0, 1/fan_in), embeddings N(0, 1), norm weights 1 + N(0, 0.1²): logits of order one, so numerical
    differences are visible."""
    if name.endswith("norm"):
        return 1.0 + 0.1 * z
    if name == "embed":
        return z
    return z / np.sqrt(fan_in)


def hf_tensor_specs(config) -> list[tuple[str, Rule, tuple[int, ...]]]:
    """(HF name, rule, HF shape) of every tensor of `config`'s checkpoint, in its name map's order (rule by
    rule, then layer by layer, then expert by expert). LLaDA2's tensors map onto "layers"/"dense"/"moe" groups
    and stacked experts (one tensor per routed expert), so `llada2_expected` names them; the dense families'
    rules each give one tensor per layer (or one in all)."""
    shapes = param_shapes_for(config)
    expected = family_of(config).hf_expected
    if expected is not None:
        return [(name, rule, hf_shape(rule.transform, target))
                for name, (rule, _, target) in expected(config, shapes).items()]
    specs = []
    for rule in rules_for(config):
        target = tree_get(shapes, rule.path)
        shape = hf_shape(rule.transform, target[1:] if rule.per_layer else target)
        specs += [(hf_name(rule, layer), rule, shape)
                  for layer in (range(config.num_layers) if rule.per_layer else [None])]
    return specs


def random_hf_tensors(config, *, seed: int = 0, dtype: str = "float32") -> dict[str, np.ndarray]:
    """{HF name: random tensor} for every weight of `config` (any family), in the HF (torch) layout,
    drawn on the host with numpy (`random_weight`) in `hf_tensor_specs`' order."""
    rng = np.random.default_rng(seed)
    return {name: random_weight(rng.standard_normal(shape), rule, shape).astype(TARGET_DTYPES[dtype])
            for name, rule, shape in hf_tensor_specs(config)}


def random_params(config, key, dtype=jnp.bfloat16) -> dict:
    """The parameter tree of `config` (the layout of `param_shapes`) with random weights drawn on the
    device, leaf by leaf, with the scheme of `random_weight`: full-size models (8B benchmarks) never
    pass through host memory. The values differ from `random_hf_tensors`' (another generator)."""
    shapes = param_shapes_for(config)
    # LLaDA2: its HF tensors map to stacked experts, so the tree's leaves are drawn directly
    if family_of(config).hf_expected is not None:
        leaves, tree = jax.tree.flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
        keys = jax.random.split(key, len(leaves))
        return jax.tree.unflatten(tree, [random_tree_leaf(k, name=path[-1].key, shape=shape, dtype=jnp.dtype(dtype))
                                         for k, (path, shape) in zip(keys, leaves)])
    rules = rules_for(config)
    params: dict = {}
    for rule, k in zip(rules, jax.random.split(key, len(rules))):
        shape = tree_get(shapes, rule.path)
        hf = hf_shape(rule.transform, shape[1:] if rule.per_layer else shape)
        node = params
        for name in rule.path[:-1]:
            node = node.setdefault(name, {})
        node[rule.path[-1]] = random_leaf(k, rule=rule, shape=shape, hf_tensor_shape=hf, dtype=jnp.dtype(dtype))
    return params


@functools.partial(jax.jit, static_argnames=("rule", "shape", "hf_tensor_shape", "dtype"))
def random_leaf(key, *, rule: Rule, shape: tuple[int, ...], hf_tensor_shape: tuple[int, ...], dtype):
    """One weight of `random_params`, jitted on its own: the float32 draw of a full-size tensor never
    coexists with the others."""
    return random_weight(jax.random.normal(key, shape, jnp.float32), rule, hf_tensor_shape).astype(dtype)


@functools.partial(jax.jit, static_argnames=("name", "shape", "dtype"))
def random_tree_leaf(key, *, name: str, shape: tuple[int, ...], dtype):
    """One leaf of a parameter tree in its own [.., in, out] layout with `leaf_weight`'s scheme, drawn in
    `dtype` (LLaDA2's [layers, experts, d, Im] stacks would need 20 GB as a float32 draw)."""
    # the HF tensor's last axis: [out, in] for a matrix, [out] for a bias or a norm (which ignores it)
    fan_in = shape[-2] if len(shape) > 1 and not name.endswith(("bias", "norm")) else shape[-1]
    return leaf_weight(jax.random.normal(key, shape, dtype), name, fan_in).astype(dtype)


def write_hf_checkpoint(directory, config, *, seed: int = 0, dtype: str = "float32", shards: int = 1,
                        tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Writes config.json + safetensors (sharded with model.safetensors.index.json if shards > 1) of
    `config`: `tensors` if given, else random weights (`random_hf_tensors`) stored as `dtype`."""
    tensors = random_hf_tensors(config, seed=seed, dtype=dtype) if tensors is None else tensors
    return write_hf_files(directory, config.to_hf_config() | {"torch_dtype": dtype}, tensors, shards=shards)


QWEN_STYLE_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_tokenizer(directory, vocab_size: int, *, mask_token_id: int | None, eos_token_id: int,
                         chat_template: str = QWEN_STYLE_TEMPLATE) -> Path:
    """A word-level tokenizer.json whose ids cover 0..vocab_size-1 ("w<i>" words, "user" and
    "assistant"; id 0 is the unknown token; mask (None: a model without one), EOS and the chat markers are
    special tokens), plus tokenizer_config.json with `chat_template`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    directory = Path(directory)
    specials = {eos_token_id: "<|im_end|>", eos_token_id - 1: "<|im_start|>"}
    if mask_token_id is not None:
        specials[mask_token_id] = "<|mask|>"
    words = {0: "[UNK]", eos_token_id - 2: "user", eos_token_id - 3: "assistant"}
    vocab = {specials.get(i, words.get(i, f"w{i}")): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(list(specials.values()))
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"chat_template": chat_template, "eos_token": "<|im_end|>", "bos_token": None}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


@contextlib.contextmanager
def compile_events():
    """Yields the list of JAX's compile events inside the block (tracing a program, lowering it, compiling it for
    the backend): a program traced anew appears here even where the persistent cache spares its compilation."""
    events = []

    def listen(event, duration, **kwargs):
        if event.startswith("/jax/core/compile"):
            events.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


@contextlib.contextmanager
def no_compilation():
    """Fails if JAX compiles anything inside the block (a refused input must cost no compilation)."""
    with compile_events() as events:
        yield
    assert not events, f"refused input still compiled: {events}"


def user_environment(environ) -> dict:
    """A copy of `environ` for a subprocess that should run as a user's does: XLA_FLAGS without the flags
    TEST_XLA_FLAGS names (`make test` compiles with LLVM at -O0, which makes 1k-token passes ~2.4x slower)."""
    env = dict(environ)
    flags = env.get("XLA_FLAGS", "").split()
    test_flags = set(env.pop("TEST_XLA_FLAGS", "").split())
    env["XLA_FLAGS"] = " ".join(flag for flag in flags if flag not in test_flags)
    return env


def jaxpr_equations(jaxpr):
    """Every equation of a jaxpr, those of nested jaxprs (jit, checkpoint, pallas_call bodies, loops)
    included: what a test walks to say what a traced program holds."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from jaxpr_equations(inner)
