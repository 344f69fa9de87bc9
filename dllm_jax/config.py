"""Frozen model configurations built from Hugging Face `config.json` files.

Every family's config is a `dllm_jax.hf_config.ModelConfig`. The masked-diffusion decoders' are `DecoderConfig`s:
the fields, checks and HF refusals they share are written once there, and the shared layers in
`dllm_jax.models.layers` read any of them by the same names (hidden_size, num_layers, qk_norm, qkv_bias, stop_ids,
...); each family's config.json keys are one declarative map (`DecoderConfig.HF`) that `from_hf_config` reads and
`to_hf_config` writes. DiffusionGemma's config (`dllm_jax.diffusion_gemma_config`: per-layer shapes, no mask
token) is imported here so that `config_from_hf` knows it. A subclass with `MODEL_TYPES` joins `config_from_hf`
by being defined (`CONFIG_CLASSES`); what the rest of the package knows about a family is its entry in
`dllm_jax.families`.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
from pathlib import Path
from typing import Any, Callable

from dllm_jax.diffusion_gemma_config import DiffusionGemmaConfig
from dllm_jax.hf_config import (CONFIG_CLASSES, REQUIRED, HFKey, ModelConfig, check_fields, check_mask_distinct,
                                check_object, check_required, check_token_ids, field_label, hf_architectures, hf_dict,
                                hf_flag, hf_int, hf_real, qwen_refusals, token_id)
from dllm_jax.quantize import check_quantize
from dllm_jax.validation import flag, integer, real

# <name>/config.json per supported public model: package data (pyproject.toml), so an installed wheel has them
SHIPPED_CONFIG_DIR = importlib.resources.files("dllm_jax") / "configs"

@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig(ModelConfig):
    """The fields every masked-diffusion decoder family has (a decoder LM with RMSNorm, RoPE and GQA attention,
    and a mask token) and the checks on them. A family's subclass redeclares a field to give it the family's
    default.

    Class attributes a family sets (not fields: fixed by its architecture, unless the family makes one a
    field, as LLaDA2 does with qk_norm / qkv_bias / o_bias, HF keys use_qk_norm / use_qkv_bias / use_bias):
      family: the family's name in `dllm_jax.families` ("llada", ...); LABEL the display name ("LLaDA").
      MODEL_TYPES / ARCHITECTURES: the HF `model_type` / `architectures` values it accepts.
      HF: its config.json map, one `HFKey` per field (read in order: a default may derive from the fields
        before it); `from_hf_config` reads it, `to_hf_config` writes it with the HF_CONSTANTS its architecture
        fixes, `HF_KEYS` ({field: key} where they differ) names both in errors.
      refusals(hf): the features of a config.json it refuses (one ValueError lists them all).
      SIZES: the fields that must be positive integers; TOKEN_IDS: the token-id fields.
      rope_in_fp32, qk_norm, qkv_bias, o_bias: the attention's variants (`models.layers.attention_sublayer`).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    mask_token_id: int
    pad_token_id: int
    # None, or how the linear layers' weights are stored (dllm_jax.quantize): set from the `dllm_jax` entry of
    # a quantized conversion's config.json, or by load_model(quantize=...); not an HF key
    quantize: str | None = None

    HF = ()
    HF_CONSTANTS = {}
    HF_KEYS = {}
    ROPE_PARAMETERS = True  # transformers 5's `rope_parameters.rope_theta` is read as `rope_theta`
    SIZES = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size",
             "max_position_embeddings")
    TOKEN_IDS = ("mask_token_id", "pad_token_id")
    rope_in_fp32 = False
    qk_norm = False  # per-head q/k RMSNorm before RoPE
    qkv_bias = False  # biases on the q/k/v projections
    o_bias = False  # a bias on the output projection

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.HF_KEYS = {k.field: k.key for k in cls.HF if k.key != k.field}

    def __post_init__(self):
        check_fields(self, sizes=self.SIZES)
        check_quantize(self.quantize, where="quantize")
        if "head_dim" not in self.__dataclass_fields__ and self.hidden_size % self.num_heads:  # a derived head_dim
            raise ValueError(f"{self.hidden_size=} must be a multiple of {self.num_heads=}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=} (GQA)")
        self.check_layout()
        self.check_ids()
        check_mask_distinct(self, self.special_ids)

    def check_layout(self) -> None:
        """The family's own checks of its sizes (after the shared ones, before the token ids)."""
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    def check_ids(self) -> None:
        check_token_ids(self, self.TOKEN_IDS)

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each head that RoPE rotates (all of them unless a family says otherwise)."""
        return self.head_dim

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The token ids that end an answer (generation stops, or pads after, the first of them)."""
        return (self.eos_token_id,)

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        return (self.mask_token_id,)

    @property
    def special_ids(self) -> tuple[int, ...]:
        """The stop and padding ids the mask id must differ from."""
        return tuple(getattr(self, name) for name in self.TOKEN_IDS if name != "mask_token_id")

    @classmethod
    def refusals(cls, hf: dict) -> list[str]:
        return []

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> DecoderConfig:
        """Builds the config from the keys of the family's HF `config.json` (its `HF` map). Refused with a
        ValueError rather than ignored: another model's `model_type` / `architectures`, the features the family's
        `refusals` names, numbers written as strings, bools or fractions, and a missing required key (among them
        `rope_theta`: the published configs give it, while the configuration code's defaults differ and would
        silently change every rotation)."""
        cls.check_hf_names(hf)
        refused = cls.refusals(hf)
        if refused:
            raise ValueError(f"unsupported {cls.LABEL} config: " + ", ".join(refused))
        params = hf_dict(hf, "rope_parameters") if cls.ROPE_PARAMETERS else {}
        if hf.get("rope_theta") is None and params.get("rope_theta") is not None:
            hf = hf | {"rope_theta": params["rope_theta"]}  # transformers 5 moved it into rope_parameters
        check_required(hf, cls.LABEL, tuple(k.key for k in cls.HF if k.default is REQUIRED))
        fields = {}
        for key in cls.HF:
            fields[key.field] = key.value(hf, fields)
        return cls(**fields)

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `config.json` dict (the family's keys) describing this config."""
        fields = {k.key: list(v) if isinstance(v := getattr(self, k.field), tuple) else v for k in self.HF}
        return {"architectures": [self.ARCHITECTURES[0]], "model_type": self.MODEL_TYPES[0]} | fields | self.HF_CONSTANTS


def same_as(name: str) -> Callable:
    """An HFKey default: the value of field `name`, read before it."""
    return lambda hf, fields: fields[name]


# LLaDA's tokenizer: <|endoftext|> (its eos) and <|eot_id|>, which the official generate.py hard-codes
LLADA_EOS, LLADA_EOT = 126081, 126348
# LLaDA's config.json keys of features its model never uses, and the values that mean "not used"
LLADA_UNUSED = {"alibi": (False, None), "rope": (True, None), "include_bias": (False, None),
                "include_qkv_bias": (False, None), "attention_layer_norm": (False, None),
                "scale_logits": (False, None), "input_emb_norm": (False, None), "layer_norm_type": ("rms", None),
                "activation_type": ("silu", None), "block_type": ("llama", None), "clip_qkv": (None,),
                "bias_for_layer_norm": (False, None)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LLaDAConfig(DecoderConfig):
    """LLaDA (LLaDA-8B-Base/Instruct, LLaDA-1.5): a bidirectional Llama-style masked-diffusion model, read from
    LLaDA's OLMo-style config.json keys.

    `vocab_size` is the number of embedding rows and logits (LLaDA's `embedding_size`, which may
    be padded beyond the tokenizer's `vocab_size`, kept as `tokenizer_vocab_size`). Features the original
    model never uses (ALiBi, biases, QK layer norm, other block or norm types, logit scaling, qkv clipping) are
    refused. Absent ids come from the file's own: pad_token_id is the eos id, eot_token_id LLaDA's <|eot_id|>
    for LLaDA's tokenizer (eos 126081, the published configs, which lack the key) and the eos id otherwise.
    """

    tokenizer_vocab_size: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    mask_token_id: int = 126336
    eos_token_id: int = LLADA_EOS
    pad_token_id: int = LLADA_EOS
    eot_token_id: int = LLADA_EOT  # <|eot_id|>; not in LLaDA's config.json (generate.py hard-codes it)

    family = "llada"
    MODEL_TYPES = ("llada",)
    ARCHITECTURES = ("LLaDAModelLM",)  # LLaDA-8B-Base/Instruct, LLaDA-1.5 (LLaDA-MoE, LLaDA2 differ)
    # LLaDA rotates q/k in fp32 (rope_full_precision) and has no per-head q/k RMSNorm.
    rope_in_fp32 = True
    ROPE_PARAMETERS = False
    HF = (HFKey("hidden_size", "d_model", hf_int), HFKey("num_heads", "n_heads", hf_int),
          HFKey("num_layers", "n_layers", hf_int),
          HFKey("num_kv_heads", "n_kv_heads", hf_int,
                lambda hf, f: 1 if hf_flag(hf, "multi_query_attention", False) else f["num_heads"]),
          HFKey("intermediate_size", "mlp_hidden_size", hf_int,
                lambda hf, f: hf_int(hf, "mlp_ratio", 4) * f["hidden_size"]),
          HFKey("tokenizer_vocab_size", "vocab_size", hf_int),
          HFKey("vocab_size", "embedding_size", hf_int, same_as("tokenizer_vocab_size")),
          HFKey("rope_theta", "rope_theta", hf_real), HFKey("rms_norm_eps", "rms_norm_eps", hf_real, 1e-5),
          HFKey("max_position_embeddings", "max_sequence_length", hf_int, 4096),
          HFKey("tie_word_embeddings", "weight_tying", hf_flag, False),
          HFKey("mask_token_id", "mask_token_id", hf_int, 126336),
          HFKey("eos_token_id", "eos_token_id", hf_int, LLADA_EOS),
          HFKey("pad_token_id", "pad_token_id", hf_int, same_as("eos_token_id")),
          HFKey("eot_token_id", "eot_token_id", hf_int,
                lambda hf, f: LLADA_EOT if f["eos_token_id"] == LLADA_EOS else f["eos_token_id"]))
    HF_CONSTANTS = {"activation_type": "silu", "block_type": "llama", "layer_norm_type": "rms", "alibi": False,
                    "rope": True, "rope_full_precision": True, "include_bias": False, "include_qkv_bias": False,
                    "attention_layer_norm": False, "scale_logits": False, "input_emb_norm": False}
    SIZES = DecoderConfig.SIZES + ("tokenizer_vocab_size",)
    TOKEN_IDS = ("mask_token_id", "eos_token_id", "pad_token_id", "eot_token_id")

    def check_layout(self) -> None:
        super().check_layout()
        if self.tokenizer_vocab_size > self.vocab_size:
            raise ValueError(f"{self.tokenizer_vocab_size=} exceeds the embedding size {self.vocab_size=}")

    @property
    def head_dim(self) -> int:  # not on the base: SDAR and LLaDA2 make it a field
        return self.hidden_size // self.num_heads

    @classmethod
    def refusals(cls, hf: dict) -> list[str]:
        return [f"{key}={hf[key]!r} (supported: {allowed[0]!r})"
                for key, allowed in LLADA_UNUSED.items() if key in hf and hf[key] not in allowed]


QWEN_ENDOFTEXT, QWEN_IM_END = 151643, 151645  # the Qwen tokenizers' <|endoftext|> and <|im_end|>
# the config.json keys the Qwen-style families share (field, key, reader)
QWEN_SHAPE = (HFKey("hidden_size", "hidden_size", hf_int), HFKey("num_layers", "num_hidden_layers", hf_int),
              HFKey("num_heads", "num_attention_heads", hf_int))
QWEN_CONSTANTS = {"rope_scaling": None, "hidden_act": "silu", "use_sliding_window": False}


def head_dim_default(hf: dict, fields: dict) -> int:
    return fields["hidden_size"] // fields["num_heads"]


def sdar_stop_ids(hf: dict, key: str, default) -> tuple[int, ...]:
    """SDAR's stop ids: one id or a list of them (absent: the Qwen chat stops); a Qwen tokenizer's <|endoftext|>
    brings <|im_end|> with it (the chat models also stop there: their generation_config.json)."""
    eos = hf.get(key)
    eos = list(default) if eos is None else eos
    eos = tuple(hf_int({key: e}, key) for e in (eos if isinstance(eos, list) else [eos]))
    return (QWEN_IM_END,) + eos if QWEN_ENDOFTEXT in eos and QWEN_IM_END not in eos else eos


@dataclasses.dataclass(frozen=True, kw_only=True)
class SDARConfig(DecoderConfig):
    """SDAR / TraDo: a Qwen3-architecture block-diffusion model (Qwen3 config.json keys plus block_size and
    mask_token_id).

    Attention is bidirectional inside each block of `block_size` tokens and causal across blocks,
    which is what makes an exact KV cache of finished blocks possible. Mixture-of-experts, attention biases,
    sliding windows and RoPE scaling are refused. An absent pad_token_id is <|endoftext|> for the Qwen
    tokenizer (stop ids holding <|im_end|>, or none), else the last stop id (a model of another vocabulary).
    """

    head_dim: int
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    block_size: int = 4
    mask_token_id: int = 151669
    eos_token_ids: tuple[int, ...] = (QWEN_IM_END, QWEN_ENDOFTEXT)
    pad_token_id: int = QWEN_ENDOFTEXT

    family = "sdar"
    # TraDo checkpoints use SDAR's code; a plain Qwen3 layout loads as SDAR too (same weights)
    MODEL_TYPES = ("sdar", "trado", "qwen3")
    ARCHITECTURES = ("SDARForCausalLM", "Qwen3ForCausalLM")
    # Qwen3: per-head q/k RMSNorm before RoPE; cos/sin are cast to the activation dtype before
    # rotating (HF Qwen3), unlike LLaDA's fp32 rotation.
    qk_norm = True
    HF = QWEN_SHAPE + (
        HFKey("num_kv_heads", "num_key_value_heads", hf_int, same_as("num_heads")),
        HFKey("head_dim", "head_dim", hf_int, head_dim_default),
        HFKey("intermediate_size", "intermediate_size", hf_int), HFKey("vocab_size", "vocab_size", hf_int),
        HFKey("rope_theta", "rope_theta", hf_real), HFKey("rms_norm_eps", "rms_norm_eps", hf_real, 1e-6),
        HFKey("max_position_embeddings", "max_position_embeddings", hf_int, 32768),
        HFKey("tie_word_embeddings", "tie_word_embeddings", hf_flag, False),
        HFKey("block_size", "block_size", hf_int, 4), HFKey("mask_token_id", "mask_token_id", hf_int, 151669),
        HFKey("eos_token_ids", "eos_token_id", sdar_stop_ids, (QWEN_IM_END, QWEN_ENDOFTEXT)),
        HFKey("pad_token_id", "pad_token_id", hf_int,
              lambda hf, f: QWEN_ENDOFTEXT if QWEN_IM_END in f["eos_token_ids"] or not f["eos_token_ids"]
              else f["eos_token_ids"][-1]))
    HF_CONSTANTS = QWEN_CONSTANTS | {"bos_token_id": QWEN_ENDOFTEXT, "attention_bias": False,
                                     "attention_dropout": 0.0}
    SIZES = DecoderConfig.SIZES + ("head_dim", "block_size")

    def __post_init__(self):
        if isinstance(self.eos_token_ids, (list, tuple)):
            # a tuple keeps the config hashable (it is a static jit argument)
            object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        else:
            raise ValueError(f"SDARConfig.eos_token_ids must be a tuple of token ids, got {self.eos_token_ids!r}")
        super().__post_init__()

    def check_ids(self) -> None:
        super().check_ids()
        object.__setattr__(self, "eos_token_ids", tuple(
            token_id(f"SDARConfig.eos_token_ids[{i}] (config.json key 'eos_token_id')", e, self.vocab_size,
                     hint="; eos_token_ids=() never stops early")
            for i, e in enumerate(self.eos_token_ids)))

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self.eos_token_ids

    @property
    def special_ids(self) -> tuple[int, ...]:
        return (self.pad_token_id, *self.eos_token_ids)

    @classmethod
    def refusals(cls, hf: dict) -> list[str]:
        return (["attention_bias=True"] if hf_flag(hf, "attention_bias", False) else []) + qwen_refusals(hf)


def dream_eos(hf: dict, key: str, default) -> int:
    """Dream's eos id: one id, or the first of a list (the official sampler reads the first)."""
    eos = hf.get(key)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return default if eos is None else hf_int({key: eos}, key)


def dream_pad(hf: dict, fields: dict) -> int:
    """An absent pad or bos id: <|endoftext|> for the Qwen tokenizer (eos <|endoftext|> or <|im_end|>), else eos."""
    eos = fields["eos_token_id"]
    return QWEN_ENDOFTEXT if eos in (QWEN_ENDOFTEXT, QWEN_IM_END) else eos


@dataclasses.dataclass(frozen=True, kw_only=True)
class DreamConfig(DecoderConfig):
    """Dream (Dream-v0-Instruct-7B / -Base-7B): a Qwen2.5-architecture masked-diffusion model (Qwen2 config.json
    keys, model_type "Dream", mask_token_id).

    Attention is fully bidirectional, as LLaDA's; the checkpoint uses HF Qwen2 names and shapes (q/k/v
    biases, GQA, head_dim = hidden_size / num_heads). Dream predicts token i from position i - 1 (the
    logits are shifted by one position in generation, `dllm_jax.generate.dream`, not in the forward).
    Sliding windows, RoPE scaling, another activation, a head_dim other than hidden_size / num_attention_heads
    and mixture-of-experts keys are refused.
    """

    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 131072
    mask_token_id: int = 151666
    eos_token_id: int = QWEN_ENDOFTEXT
    pad_token_id: int = QWEN_ENDOFTEXT
    bos_token_id: int = QWEN_ENDOFTEXT

    family = "dream"
    MODEL_TYPES = ("dream",)
    ARCHITECTURES = ("DreamModel",)
    # Qwen2: biases on q/k/v (not o), no q/k RMSNorm; cos/sin cast to the activation dtype before
    # rotating (the official modeling_dream.py, as HF Qwen2).
    qkv_bias = True
    HF = QWEN_SHAPE + (
        HFKey("num_kv_heads", "num_key_value_heads", hf_int, same_as("num_heads")),
        HFKey("intermediate_size", "intermediate_size", hf_int), HFKey("vocab_size", "vocab_size", hf_int),
        HFKey("rope_theta", "rope_theta", hf_real), HFKey("rms_norm_eps", "rms_norm_eps", hf_real, 1e-6),
        HFKey("max_position_embeddings", "max_position_embeddings", hf_int, 131072),
        HFKey("tie_word_embeddings", "tie_word_embeddings", hf_flag, False),
        HFKey("mask_token_id", "mask_token_id", hf_int, 151666),
        HFKey("eos_token_id", "eos_token_id", dream_eos, QWEN_ENDOFTEXT),
        HFKey("pad_token_id", "pad_token_id", hf_int, dream_pad),
        HFKey("bos_token_id", "bos_token_id", hf_int, dream_pad))
    HF_CONSTANTS = QWEN_CONSTANTS | {"model_type": "Dream", "attention_dropout": 0.0, "sliding_window": None}
    TOKEN_IDS = ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id")

    @property
    def head_dim(self) -> int:  # not on the base: SDAR and LLaDA2 make it a field
        return self.hidden_size // self.num_heads

    @classmethod
    def refusals(cls, hf: dict) -> list[str]:
        bad = qwen_refusals(hf)
        if hf.get("head_dim") is not None and hf.get("hidden_size") and hf.get("num_attention_heads") and \
                hf_int(hf, "head_dim") * hf_int(hf, "num_attention_heads") != hf_int(hf, "hidden_size"):
            bad.append(f"head_dim={hf['head_dim']!r} (Dream's is hidden_size / num_attention_heads)")
        return bad


@dataclasses.dataclass(frozen=True, kw_only=True)
class LLaDA2Config(DecoderConfig):
    """LLaDA2.0 / 2.1 (inclusionAI; LLaDA2.0-mini, -flash): a Ling 2.0 (BailingMoeV2) MoE decoder run as
    a block-diffusion model (bidirectional inside each block, causal across blocks).

    Layers 0..first_k_dense_replace-1 have a dense SwiGLU MLP of `intermediate_size`; the others a
    sparse MoE: `num_experts` routed experts of `moe_intermediate_size` (sigmoid router with a
    per-expert bias used for selection only, group-limited top-k over `n_group` groups keeping
    `topk_group`, weights renormalised when top-k > 1 and scaled by `routed_scaling_factor`) plus
    `num_shared_experts` shared experts (one SwiGLU of num_shared_experts * moe_intermediate_size).
    Attention: one fused query_key_value projection (a bias with `qkv_bias`, HF `use_qkv_bias`; the output
    projection's with `o_bias`, HF `use_bias`), per-head q/k RMSNorm (`qk_norm`, HF `use_qk_norm`), RoPE
    on the first `rotary_dim` = head_dim * partial_rotary_factor dimensions of each head. The HF key
    `norm_topk_prob` is not read: the official modeling file renormalises the routing weights whenever
    top-k > 1 whatever it says, and so does this port (`to_hf_config` writes the published `true`).
    `block_size` is the sampler's default block length (32; not a key of the Hub config.json). Refused: RoPE
    scaling, a sliding window, an activation other than silu, a score function other than sigmoid, and a
    config without experts. Facts: dllm_jax/configs/llada2.0-mini/README.md.
    """

    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    rope_theta: float = 600000.0
    partial_rotary_factor: float = 0.5
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = True
    block_size: int = 32
    mask_token_id: int = 156895
    eos_token_id: int = 156892
    pad_token_id: int = 156892

    family = "llada2"
    MODEL_TYPES = ("llada2_moe",)
    ARCHITECTURES = ("LLaDA2MoeModelLM",)
    # cos/sin are cast to the activation dtype before rotating (the official rotary embedding returns
    # them in x.dtype), as HF Llama/Qwen3

    HF = QWEN_SHAPE + (
        HFKey("num_kv_heads", "num_key_value_heads", hf_int), HFKey("head_dim", "head_dim", hf_int, head_dim_default),
        HFKey("intermediate_size", "intermediate_size", hf_int),
        HFKey("moe_intermediate_size", "moe_intermediate_size", hf_int), HFKey("num_experts", "num_experts", hf_int),
        HFKey("num_experts_per_tok", "num_experts_per_tok", hf_int),
        HFKey("num_shared_experts", "num_shared_experts", hf_int, 0), HFKey("n_group", "n_group", hf_int, 1),
        HFKey("topk_group", "topk_group", hf_int, 1),
        HFKey("routed_scaling_factor", "routed_scaling_factor", hf_real, 1.0),
        HFKey("first_k_dense_replace", "first_k_dense_replace", hf_int, 0), HFKey("vocab_size", "vocab_size", hf_int),
        HFKey("rope_theta", "rope_theta", hf_real),
        HFKey("partial_rotary_factor", "partial_rotary_factor", hf_real, 1.0),
        HFKey("rms_norm_eps", "rms_norm_eps", hf_real, 1e-5),
        HFKey("max_position_embeddings", "max_position_embeddings", hf_int, 32768),
        HFKey("tie_word_embeddings", "tie_word_embeddings", hf_flag, False),
        HFKey("qkv_bias", "use_qkv_bias", hf_flag, False), HFKey("o_bias", "use_bias", hf_flag, False),
        HFKey("qk_norm", "use_qk_norm", hf_flag, False), HFKey("block_size", "block_size", hf_int, 32),
        HFKey("mask_token_id", "mask_token_id", hf_int, 156895), HFKey("eos_token_id", "eos_token_id", hf_int, 156892),
        HFKey("pad_token_id", "pad_token_id", hf_int, same_as("eos_token_id")))
    # the routing weights are renormalised whenever top-k > 1, whatever norm_topk_prob says (class docstring)
    HF_CONSTANTS = QWEN_CONSTANTS | {"norm_topk_prob": True, "score_function": "sigmoid",
                                     "moe_router_enable_expert_bias": True}
    SIZES = DecoderConfig.SIZES + ("head_dim", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
                                   "n_group", "topk_group", "block_size")
    TOKEN_IDS = ("mask_token_id", "eos_token_id", "pad_token_id")

    def check_layout(self) -> None:
        for name in ("num_shared_experts", "first_k_dense_replace"):
            object.__setattr__(self, name, integer(field_label(self, name), getattr(self, name), minimum=0))
        for name in ("routed_scaling_factor", "partial_rotary_factor"):
            object.__setattr__(self, name, real(field_label(self, name), getattr(self, name), low=0, low_open=True))
        for name in ("qkv_bias", "o_bias", "qk_norm"):
            object.__setattr__(self, name, flag(field_label(self, name), getattr(self, name)))
        if self.partial_rotary_factor > 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim = int(head_dim * partial_rotary_factor) = {self.rotary_dim} must be even, "
                             f">= 2 and <= head_dim={self.head_dim}")
        if self.first_k_dense_replace > self.num_layers:
            raise ValueError(f"{self.first_k_dense_replace=} exceeds {self.num_layers=}")
        if self.num_experts % self.n_group:
            raise ValueError(f"{self.num_experts=} must be a multiple of {self.n_group=} (expert groups)")
        if self.topk_group > self.n_group:
            raise ValueError(f"{self.topk_group=} exceeds {self.n_group=}")
        if self.num_experts // self.n_group < 2:
            raise ValueError(f"each of the n_group={self.n_group} groups needs at least 2 experts (a group "
                             "scores by its top-2 experts)")
        if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"{self.num_experts_per_tok=} exceeds the experts of the topk_group={self.topk_group} "
                             f"selected groups ({self.topk_group * (self.num_experts // self.n_group)})")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def num_dense_layers(self) -> int:
        return self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense_replace

    @classmethod
    def refusals(cls, hf: dict) -> list[str]:
        bad = qwen_refusals(hf, moe=False)
        if hf.get("score_function", "sigmoid") != "sigmoid":
            bad.append(f"score_function={hf['score_function']!r} (supported: 'sigmoid')")
        if hf.get("num_experts") is None:
            bad.append("num_experts=null (a dense model: the official code builds no MoE layer)")
        return bad


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Detects the model family of an HF `config.json` dict (model_type, else architectures) and
    builds its config; the family's own checks then refuse anything the other key contradicts."""
    check_object(hf)
    model_type = str(hf.get("model_type") or "").lower()
    architectures = hf_architectures(hf)
    for cls in CONFIG_CLASSES:
        if model_type in cls.MODEL_TYPES or (not model_type and set(architectures) & set(cls.ARCHITECTURES)):
            return cls.from_hf_config(hf)
    raise ValueError(
        f"unsupported model: model_type={hf.get('model_type')!r}, "
        f"architectures={hf.get('architectures')!r} (supported: {', '.join(c.LABEL for c in CONFIG_CLASSES)})")


def read_hf_config(directory: str | Path) -> tuple[dict[str, Any], ModelConfig]:
    """Reads `config.json` from a checkpoint directory: (raw dict, parsed config)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path} not found: a checkpoint directory needs its config.json")
    try:
        raw = json.loads(path.read_text())
    except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for a binary file
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    try:
        config = config_from_hf(raw)
        entry = raw.get("dllm_jax")
        if isinstance(entry, dict) and entry.get("quantize") is not None:  # a quantized conversion
            config = dataclasses.replace(config, quantize=entry["quantize"])
        return raw, config
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None  # which file: a checkpoint may be one of several


def shipped_config(name: str) -> ModelConfig:
    """The config of a supported public model, e.g. `shipped_config("llada-8b-instruct")`: its Hub
    config.json, shipped in the package (dllm_jax/configs/<name>/config.json)."""
    names = sorted(p.name for p in SHIPPED_CONFIG_DIR.iterdir() if (p / "config.json").is_file())
    if name not in names:
        raise ValueError(f"no shipped config named {name!r}; available: {names}")
    with importlib.resources.as_file(SHIPPED_CONFIG_DIR / name) as directory:  # a real directory, even from a zip
        return read_hf_config(directory)[1]


__all__ = ["CONFIG_CLASSES", "DecoderConfig", "DiffusionGemmaConfig", "DreamConfig", "LLaDA2Config", "LLaDAConfig",
           "ModelConfig", "SDARConfig", "config_from_hf", "read_hf_config", "shipped_config"]
