"""DiffusionGemma's text configuration, read strictly from a transformers `config.json`.

DiffusionGemma (transformers' `DiffusionGemmaForBlockDiffusion`) is a Gemma-4 text stack run twice with one set
of weights: causally over the prompt (the encoder, which fills a KV cache) and bidirectionally over a canvas of
`canvas_length` tokens that attends to that cache (the decoder). Only the text model is read here: a file's
`vision_config` (the Gemma-4 vision tower and its projection) is skipped, so prompts are text only.

What the reader accepts is what the JAX port computes exactly; anything else is a ValueError naming the key:
  * `use_bidirectional_attention` null or "vision" (identical for text prompts: a causal encoder); "all"
    (a bidirectional encoder, whose sliding window transformers also halves) is refused;
  * `layer_types` of "sliding_attention" / "full_attention" only (null: transformers' 5:1 pattern; the last
    layer is made global, as transformers does);
  * per-layer `head_dim` / `num_key_value_heads` from `per_layer_config` (absent: global layers take
    `global_head_dim`, default 512, and `num_global_key_value_heads`), the same within each layer type;
  * RoPE per layer type: "default" (all dimensions rotated) or "proportional" (the first
    partial_rotary_factor of the frequencies, each over the whole head_dim, the rest left unrotated);
  * a tied LM head (`tie_word_embeddings` true: transformers also unties encoder from decoder otherwise),
    no attention biases, a GELU activation.
The stop ids are the text config's `eos_token_id` (one id or a list), the padding id its `pad_token_id`. There is
no mask token: the model denoises canvases of uniformly random tokens (`dllm_jax.generate.diffusion_gemma`).
`to_hf_config` writes a text-only config.json that `from_hf_config` reads back as the same config.
"""

from __future__ import annotations

import dataclasses

from dllm_jax.hf_config import ModelConfig, check_object, hf_dict, hf_int, hf_real, token_id
from dllm_jax.quantize import check_quantize
from dllm_jax.validation import choice, flag

SLIDING, GLOBAL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, GLOBAL)
ROPE_TYPES = ("default", "proportional")
# transformers' ACT2FN names -> whether jax.nn.gelu uses the tanh approximation
ACTIVATIONS = {"gelu_pytorch_tanh": True, "gelu_new": True, "gelu": False}
# what transformers' config fills in for absent keys
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                GLOBAL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
DEFAULT_GLOBAL_HEAD_DIM = 512
SLIDING_PATTERN = 6  # every sixth layer global when `layer_types` is absent
DEFAULT_CONTEXT = 131_072  # transformers' max_position_embeddings default


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """One layer type's rotary embedding: `rotated` of the head_dim / 2 frequencies
    1 / theta ** (2 j / head_dim) (each divided by `factor`), the others zero (those pairs pass unrotated)."""

    theta: float
    head_dim: int
    rotated: int
    factor: float = 1.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class DiffusionGemmaConfig(ModelConfig):
    """The text model's shape and token ids (hashable: a static jit argument). Per-layer tuples are indexed by
    layer."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    sliding_window: int
    rope: tuple[tuple[str, RopeConfig], ...]  # (layer type, its RoPE) for each type present
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    rms_norm_eps: float = 1e-6
    gelu_tanh: bool = True
    final_logit_softcapping: float = 30.0
    canvas_length: int = 256
    max_position_embeddings: int = DEFAULT_CONTEXT
    eos_token_ids: tuple[int, ...] = (1,)
    pad_token_id: int = 0
    # None, or how the linear layers' weights are stored (`dllm_jax.quantize`; not an HF key, as other families')
    quantize: str | None = None

    family = "diffusiongemma"
    MODEL_TYPES = ("diffusion_gemma", "diffusion_gemma_text")
    ARCHITECTURES = ("DiffusionGemmaForBlockDiffusion",)
    tie_word_embeddings = True  # the only layout read (module docstring)

    def __post_init__(self):
        check_quantize(self.quantize, where="quantize")
        n = len(self.layer_types)
        if len(self.head_dims) != n or len(self.kv_heads) != n:
            raise ValueError(f"head_dims ({len(self.head_dims)}) and kv_heads ({len(self.kv_heads)}) must have one "
                             f"entry per layer ({n})")
        for layer, kv in enumerate(self.kv_heads):
            if self.num_heads % kv:
                raise ValueError(f"num_attention_heads={self.num_heads} must be a multiple of layer {layer}'s "
                                 f"num_key_value_heads={kv}")
        if self.top_k_experts > self.num_experts:
            raise ValueError(f"top_k_experts={self.top_k_experts} must be <= num_experts={self.num_experts}")
        # a tuple keeps the config hashable (a static jit argument)
        object.__setattr__(self, "eos_token_ids", tuple(
            token_id(f"eos_token_ids[{i}] (config.json key 'eos_token_id')", e, self.vocab_size)
            for i, e in enumerate(self.eos_token_ids)))
        object.__setattr__(self, "pad_token_id", token_id("pad_token_id", self.pad_token_id, self.vocab_size))

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.eos_token_ids

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def rope_of(self, layer_type: str) -> RopeConfig:
        return dict(self.rope)[layer_type]

    @classmethod
    def from_hf_config(cls, hf: dict) -> DiffusionGemmaConfig:
        """The config of a transformers DiffusionGemma config.json (a dict; the module docstring says what is
        read)."""
        cls.check_hf_names(hf)
        return cls(**read_fields(hf))

    def to_hf_config(self) -> dict:
        """A text-only transformers config.json describing this config (no vision tower)."""
        first = {kind: self.layer_types.index(kind) for kind in reversed(self.layer_types)}
        base = first.get(SLIDING, 0)  # the global head_dim / KV heads; the other type's go to per_layer_config
        per_layer = {str(i): {"head_dim": d, "num_key_value_heads": kv}
                     for i, (d, kv) in enumerate(zip(self.head_dims, self.kv_heads))
                     if (d, kv) != (self.head_dims[base], self.kv_heads[base])}
        text = dict(
            model_type="diffusion_gemma_text", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, head_dim=self.head_dims[base], num_key_value_heads=self.kv_heads[base],
            per_layer_config=per_layer, layer_types=list(self.layer_types), sliding_window=self.sliding_window,
            rope_parameters={kind: rope_hf(rope) for kind, rope in self.rope}, num_experts=self.num_experts,
            top_k_experts=self.top_k_experts, moe_intermediate_size=self.moe_intermediate_size,
            rms_norm_eps=self.rms_norm_eps, final_logit_softcapping=self.final_logit_softcapping,
            hidden_activation="gelu_pytorch_tanh" if self.gelu_tanh else "gelu",
            max_position_embeddings=self.max_position_embeddings, eos_token_id=list(self.eos_token_ids),
            pad_token_id=self.pad_token_id, attention_bias=False, tie_word_embeddings=True)
        return dict(architectures=[self.ARCHITECTURES[0]], model_type=self.MODEL_TYPES[0],
                    canvas_length=self.canvas_length, tie_word_embeddings=True, text_config=text)


def rope_hf(rope: RopeConfig) -> dict:
    """A RoPE's `rope_parameters` entry: default where every frequency rotates, else proportional."""
    if rope.rotated == rope.head_dim // 2 and rope.factor == 1.0:
        return {"rope_type": "default", "rope_theta": rope.theta}
    return {"rope_type": "proportional", "rope_theta": rope.theta, "factor": rope.factor,
            "partial_rotary_factor": 2 * rope.rotated / rope.head_dim}


def text_config(hf) -> tuple[dict, dict]:
    """(the text config's keys, the top level's): a whole DiffusionGemma config.json holds the text model under
    `text_config` (and a vision tower, skipped); a bare text config is both."""
    check_object(hf)
    if hf.get("model_type") not in (None, "diffusion_gemma", "diffusion_gemma_text"):
        raise ValueError(f"config.json key 'model_type' must be 'diffusion_gemma' or 'diffusion_gemma_text', got "
                         f"{hf['model_type']!r}")
    if "text_config" not in hf:
        return hf, hf
    text = hf["text_config"]
    if not isinstance(text, dict):
        raise ValueError(f"config.json key 'text_config' must be an object, got {text!r:.80}")
    return text, hf


def read_layer_types(text: dict, num_layers: int) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None:
        types = [SLIDING if (i + 1) % SLIDING_PATTERN else GLOBAL for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ValueError(f"config.json key 'layer_types' must list one type per layer ({num_layers}), got {types!r}")
    for kind in types:
        choice("config.json key 'layer_types' entry", kind, LAYER_TYPES)
    return tuple(types[:-1]) + (GLOBAL,)  # transformers forces the last layer global


def per_layer_shapes(text: dict, types: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(head_dim, num_key_value_heads) of every layer: the global values, overridden by `per_layer_config`."""
    head_dim = hf_int(text, "head_dim")
    kv = hf_int(text, "num_key_value_heads")
    overrides = text.get("per_layer_config")
    if overrides is None:  # what transformers' config derives for a file without per_layer_config
        global_shape = {"head_dim": hf_int(text, "global_head_dim", DEFAULT_GLOBAL_HEAD_DIM)}
        if text.get("num_global_key_value_heads") is not None:
            global_shape["num_key_value_heads"] = hf_int(text, "num_global_key_value_heads")
        overrides = {str(i): global_shape for i, kind in enumerate(types) if kind == GLOBAL}
    if not isinstance(overrides, dict):
        raise ValueError(f"config.json key 'per_layer_config' must be an object, got {overrides!r:.80}")
    layers = {}
    for key, values in overrides.items():
        if not (isinstance(key, str) and key.isdigit() and int(key) < len(types)) or not isinstance(values, dict):
            raise ValueError(f"config.json key 'per_layer_config' must map layer indices [0, {len(types)}) to "
                             f"objects, got {key!r}: {values!r:.80}")
        unknown = sorted(set(values) - {"head_dim", "num_key_value_heads"})
        if unknown:
            raise ValueError(f"config.json key 'per_layer_config' overrides {unknown} of layer {key}: only head_dim "
                             "and num_key_value_heads are supported")
        layers[int(key)] = values
    head_dims = tuple(hf_int(layers.get(i, {}), "head_dim", head_dim) for i in range(len(types)))
    kv_heads = tuple(hf_int(layers.get(i, {}), "num_key_value_heads", kv) for i in range(len(types)))
    for kind in set(types):  # transformers builds one RoPE table per layer type, from its first layer
        shapes = {(head_dims[i], kv_heads[i]) for i, t in enumerate(types) if t == kind}
        if len(shapes) > 1:
            raise ValueError(f"config.json key 'per_layer_config' gives the {kind} layers different (head_dim, "
                             f"num_key_value_heads) {sorted(shapes)}: one per layer type is supported")
    return head_dims, kv_heads


def read_rope(text: dict, kind: str, head_dim: int) -> RopeConfig:
    params = hf_dict(text, "rope_parameters") or DEFAULT_ROPE
    if not isinstance(params.get(kind), dict):
        raise ValueError(f"config.json key 'rope_parameters' lacks an object for the layer type {kind!r}")
    rope = params[kind]
    where = f"rope_parameters.{kind}"
    rope_type = choice(f"config.json key '{where}.rope_type'", rope.get("rope_type"), ROPE_TYPES)
    allowed = {"rope_type", "rope_theta"} | ({"partial_rotary_factor", "factor"} if rope_type == "proportional" else
                                             {"partial_rotary_factor"})
    unknown = sorted(set(rope) - allowed)
    if unknown:
        raise ValueError(f"config.json key '{where}' sets {unknown}, unsupported for rope_type {rope_type!r}")
    theta = hf_real(rope, "rope_theta")
    fraction = hf_real(rope, "partial_rotary_factor", 1.0)
    if rope_type == "default":
        if fraction != 1.0:  # transformers would build tables narrower than the heads they rotate
            raise ValueError(f"config.json key '{where}.partial_rotary_factor' must be 1.0 for default RoPE, got "
                             f"{fraction}")
        return RopeConfig(theta=theta, head_dim=head_dim, rotated=head_dim // 2)
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"config.json key '{where}.partial_rotary_factor' must lie in [0, 1], got {fraction}")
    factor = hf_real(rope, "factor", 1.0)
    if factor <= 0:
        raise ValueError(f"config.json key '{where}.factor' must be positive, got {factor}")
    return RopeConfig(theta=theta, head_dim=head_dim, rotated=int(fraction * head_dim // 2), factor=factor)


def check_supported(text: dict, top: dict) -> None:
    """The refusals of the module docstring."""
    mode = text.get("use_bidirectional_attention")
    if mode not in (None, "vision"):
        raise ValueError(f"config.json key 'use_bidirectional_attention' = {mode!r} is unsupported (null or "
                         "'vision': a causal encoder over text prompts)")
    if text.get("attention_bias"):
        raise ValueError("config.json key 'attention_bias' = true is unsupported (Gemma-4 has no attention biases)")
    for where in (text, top):
        if not flag("config.json key 'tie_word_embeddings'", where.get("tie_word_embeddings", True)):
            raise ValueError("config.json key 'tie_word_embeddings' = false is unsupported (it also unties the "
                             "encoder's weights from the decoder's)")
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if text.get(key) is None:  # transformers builds the experts of every layer from these
            raise ValueError(f"config.json lacks the required key {key!r} (every DiffusionGemma layer has experts)")


def read_stop_ids(text: dict, top: dict) -> tuple[int, ...]:
    """The text config's eos_token_id (else the top level's): one id or a list; absent: transformers' default 1."""
    eos = text.get("eos_token_id", top.get("eos_token_id"))
    eos = [1] if eos is None else eos if isinstance(eos, list) else [eos]
    return tuple(hf_int({"eos_token_id": e}, "eos_token_id") for e in eos)


def read_fields(hf: dict) -> dict:
    """DiffusionGemmaConfig's fields of a config.json (the module docstring says what is read)."""
    text, top = text_config(hf)
    check_supported(text, top)
    num_layers = hf_int(text, "num_hidden_layers")
    if num_layers < 1:
        raise ValueError(f"config.json key 'num_hidden_layers' must be a positive integer, got {num_layers}")
    types = read_layer_types(text, num_layers)
    head_dims, kv_heads = per_layer_shapes(text, types)
    rope = tuple((kind, read_rope(text, kind, head_dims[types.index(kind)])) for kind in LAYER_TYPES if kind in types)
    activation = choice("config.json key 'hidden_activation'", text.get("hidden_activation", "gelu_pytorch_tanh"),
                        tuple(ACTIVATIONS))
    softcap = hf_real(text, "final_logit_softcapping", 30.0)
    if softcap <= 0:
        raise ValueError(f"config.json key 'final_logit_softcapping' must be positive, got {softcap}")
    eps = hf_real(text, "rms_norm_eps", 1e-6)
    if eps <= 0:
        raise ValueError(f"config.json key 'rms_norm_eps' must be positive, got {eps}")
    sizes = {field: hf_int(text, key) for field, key in (
        ("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"), ("intermediate_size", "intermediate_size"),
        ("num_heads", "num_attention_heads"), ("sliding_window", "sliding_window"), ("num_experts", "num_experts"),
        ("top_k_experts", "top_k_experts"), ("moe_intermediate_size", "moe_intermediate_size"))}
    sizes["canvas_length"] = hf_int(top, "canvas_length", 256)
    sizes["max_position_embeddings"] = hf_int(text, "max_position_embeddings", DEFAULT_CONTEXT)
    for field, value in sizes.items():
        if value < 1:
            raise ValueError(f"config.json: {field} must be a positive integer, got {value}")
    for layer, (d, kv) in enumerate(zip(head_dims, kv_heads)):
        if d < 1 or d % 2 or kv < 1:
            raise ValueError(f"config.json: layer {layer} needs an even head_dim and num_key_value_heads >= 1, got "
                             f"head_dim={d}, num_key_value_heads={kv} (head_dim / per_layer_config)")
    return dict(layer_types=types, head_dims=head_dims, kv_heads=kv_heads, rope=rope, rms_norm_eps=eps,
                gelu_tanh=ACTIVATIONS[activation], final_logit_softcapping=softcap,
                eos_token_ids=read_stop_ids(text, top), pad_token_id=hf_int(text, "pad_token_id", 0), **sizes)


__all__ = ["DiffusionGemmaConfig", "RopeConfig", "SLIDING", "GLOBAL"]
