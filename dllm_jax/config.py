"""Frozen model configurations built from Hugging Face `config.json` files.

Every family's config is a `DecoderConfig`: the fields, checks and HF refusals the families share are
written once there, and the shared layers in `dllm_jax.models.layers` read any config by the same names
(hidden_size, num_layers, qk_norm, qkv_bias, stop_ids, ...); `from_hf_config` maps each family's own
keys. A subclass with `MODEL_TYPES` joins `config_from_hf` by being defined (`CONFIG_CLASSES`); what the
rest of the package knows about a family is its entry in `dllm_jax.families`.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
from pathlib import Path
from typing import Any

from dllm_jax.quantize import check_quantize
from dllm_jax.validation import flag, integer, real

# <name>/config.json per supported public model: package data (pyproject.toml), so an installed wheel has them
SHIPPED_CONFIG_DIR = importlib.resources.files("dllm_jax") / "configs"

CONFIG_CLASSES: list[type[DecoderConfig]] = []  # every family's config class, in definition order


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """The fields every family has (a decoder LM with RMSNorm, RoPE and GQA attention, and a mask token)
    and the checks on them. A family's subclass redeclares a field to give it the family's default.

    Class attributes a family sets (not fields: fixed by its architecture, unless the family makes one a
    field, as LLaDA2 does with qk_norm / qkv_bias / o_bias, HF keys use_qk_norm / use_qkv_bias / use_bias):
      family: the family's name in `dllm_jax.families` ("llada", ...); LABEL the display name ("LLaDA").
      MODEL_TYPES / ARCHITECTURES: the HF `model_type` / `architectures` values it accepts.
      HF_KEYS: {field: config.json key} where they differ (error messages name both).
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

    family = ""
    LABEL = ""
    MODEL_TYPES = ()
    ARCHITECTURES = ()
    HF_KEYS = {}
    SIZES = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size",
             "max_position_embeddings")
    TOKEN_IDS = ("mask_token_id", "pad_token_id")
    rope_in_fp32 = False
    qk_norm = False  # per-head q/k RMSNorm before RoPE
    qkv_bias = False  # biases on the q/k/v projections
    o_bias = False  # a bias on the output projection

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.LABEL = cls.__name__.removesuffix("Config")
        if cls.MODEL_TYPES:
            CONFIG_CLASSES.append(cls)

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
    def special_ids(self) -> tuple[int, ...]:
        """The stop and padding ids the mask id must differ from."""
        return tuple(getattr(self, name) for name in self.TOKEN_IDS if name != "mask_token_id")

    @classmethod
    def check_hf(cls, hf: dict, refused: list[str], required: tuple[str, ...], *, rope_parameters: bool = True) -> dict:
        """The checks every family's `from_hf_config` makes after `check_hf_names`: no `refused` feature
        (one ValueError listing them all), transformers 5's `rope_parameters.rope_theta` read as
        `rope_theta` (with `rope_parameters`: the Qwen-style configs), and every `required` key present.
        Returns the dict to read the fields from."""
        if refused:
            raise ValueError(f"unsupported {cls.LABEL} config: " + ", ".join(refused))
        params = hf_dict(hf, "rope_parameters") if rope_parameters else {}
        if hf.get("rope_theta") is None and params.get("rope_theta") is not None:
            hf = hf | {"rope_theta": params["rope_theta"]}  # transformers 5 moved it into rope_parameters
        check_required(hf, cls.LABEL, required)
        return hf


def qwen_refusals(hf: dict, *, moe: bool = True) -> list[str]:
    """What the Qwen-style families (SDAR, Dream, LLaDA2) refuse alike: an activation other than silu,
    mixture-of-experts keys (`moe`: for the dense ones), a sliding window, RoPE scaling."""
    bad = []
    if hf.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={hf['hidden_act']!r} (supported: 'silu')")
    if moe and (hf.get("num_experts") or hf.get("moe_intermediate_size")):
        bad.append("mixture-of-experts layers (num_experts)")
    if hf_flag(hf, "use_sliding_window", False):
        bad.append("use_sliding_window=True")
    rope, params = hf_dict(hf, "rope_scaling"), hf_dict(hf, "rope_parameters")
    rope_type = rope.get("rope_type", rope.get("type")) or params.get("rope_type", "default")
    if rope_type != "default":
        bad.append(f"rope scaling {rope_type!r}")
    return bad


# LLaDA's tokenizer: <|endoftext|> (its eos) and <|eot_id|>, which the official generate.py hard-codes
LLADA_EOS, LLADA_EOT = 126081, 126348


@dataclasses.dataclass(frozen=True, kw_only=True)
class LLaDAConfig(DecoderConfig):
    """LLaDA (LLaDA-8B-Base/Instruct, LLaDA-1.5): a bidirectional Llama-style masked-diffusion model.

    `vocab_size` is the number of embedding rows and logits (LLaDA's `embedding_size`, which may
    be padded beyond the tokenizer's `vocab_size`, kept as `tokenizer_vocab_size`).
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

    HF_KEYS = {"hidden_size": "d_model", "num_layers": "n_layers", "num_heads": "n_heads",
               "num_kv_heads": "n_kv_heads", "intermediate_size": "mlp_hidden_size", "vocab_size": "embedding_size",
               "tokenizer_vocab_size": "vocab_size", "max_position_embeddings": "max_sequence_length",
               "tie_word_embeddings": "weight_tying"}
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
    def from_hf_config(cls, hf: dict[str, Any]) -> LLaDAConfig:
        """Builds the config from the keys of LLaDA's HF `config.json` (OLMo-style names).

        Features the original model never uses (ALiBi, biases, QK layer norm, other block or norm
        types, logit scaling, qkv clipping) are rejected with a ValueError rather than ignored, and so
        are another model's `model_type` / `architectures`, numbers written as strings, bools or
        fractions, and a missing `rope_theta` (the published configs give 500000; OLMo's code
        default, 10000, would silently change every rotation). Absent ids come from the file's own:
        pad_token_id is the eos id, eot_token_id LLaDA's <|eot_id|> for LLaDA's tokenizer (eos 126081,
        the published configs, which lack the key) and the eos id otherwise (a model of another vocabulary).
        """
        check_hf_names(hf, cls)
        unsupported = {
            "alibi": (False, None), "rope": (True, None), "include_bias": (False, None),
            "include_qkv_bias": (False, None), "attention_layer_norm": (False, None),
            "scale_logits": (False, None), "input_emb_norm": (False, None),
            "layer_norm_type": ("rms", None), "activation_type": ("silu", None),
            "block_type": ("llama", None), "clip_qkv": (None,), "bias_for_layer_norm": (False, None),
        }
        bad = [f"{key}={hf[key]!r} (supported: {allowed[0]!r})"
               for key, allowed in unsupported.items() if key in hf and hf[key] not in allowed]
        hf = cls.check_hf(hf, bad, ("d_model", "n_heads", "n_layers", "vocab_size", "rope_theta"), rope_parameters=False)
        d_model, n_heads = hf_int(hf, "d_model"), hf_int(hf, "n_heads")
        n_kv_heads = hf_int(hf, "n_kv_heads", None)
        if n_kv_heads is None:
            n_kv_heads = 1 if hf_flag(hf, "multi_query_attention", False) else n_heads
        mlp = hf_int(hf, "mlp_hidden_size", None)
        if mlp is None:
            mlp = hf_int(hf, "mlp_ratio", 4) * d_model
        vocab = hf_int(hf, "vocab_size")
        eos = hf_int(hf, "eos_token_id", LLADA_EOS)
        return cls(
            hidden_size=d_model, num_layers=hf_int(hf, "n_layers"), num_heads=n_heads, num_kv_heads=n_kv_heads,
            intermediate_size=mlp, vocab_size=hf_int(hf, "embedding_size", vocab), tokenizer_vocab_size=vocab,
            rope_theta=hf_real(hf, "rope_theta"), rms_norm_eps=hf_real(hf, "rms_norm_eps", 1e-5),
            max_position_embeddings=hf_int(hf, "max_sequence_length", 4096),
            tie_word_embeddings=hf_flag(hf, "weight_tying", False),
            mask_token_id=hf_int(hf, "mask_token_id", 126336), eos_token_id=eos,
            pad_token_id=hf_int(hf, "pad_token_id", eos),
            eot_token_id=hf_int(hf, "eot_token_id", LLADA_EOT if eos == LLADA_EOS else eos),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `config.json` dict (LLaDA's keys) describing this config."""
        return {
            "architectures": ["LLaDAModelLM"], "model_type": "llada",
            "d_model": self.hidden_size, "n_layers": self.num_layers, "n_heads": self.num_heads,
            "n_kv_heads": self.num_kv_heads, "mlp_hidden_size": self.intermediate_size,
            "embedding_size": self.vocab_size, "vocab_size": self.tokenizer_vocab_size,
            "rope_theta": self.rope_theta, "rms_norm_eps": self.rms_norm_eps,
            "max_sequence_length": self.max_position_embeddings,
            "weight_tying": self.tie_word_embeddings, "mask_token_id": self.mask_token_id,
            "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id,
            "eot_token_id": self.eot_token_id,
            "activation_type": "silu", "block_type": "llama", "layer_norm_type": "rms",
            "alibi": False, "rope": True, "rope_full_precision": True, "include_bias": False,
            "include_qkv_bias": False, "attention_layer_norm": False, "scale_logits": False,
            "input_emb_norm": False,
        }


QWEN_ENDOFTEXT, QWEN_IM_END = 151643, 151645  # the Qwen tokenizers' <|endoftext|> and <|im_end|>


@dataclasses.dataclass(frozen=True, kw_only=True)
class SDARConfig(DecoderConfig):
    """SDAR / TraDo: a Qwen3-architecture block-diffusion model.

    Attention is bidirectional inside each block of `block_size` tokens and causal across blocks,
    which is what makes an exact KV cache of finished blocks possible.
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

    HF_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
               "num_kv_heads": "num_key_value_heads", "eos_token_ids": "eos_token_id"}
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
    def from_hf_config(cls, hf: dict[str, Any]) -> SDARConfig:
        """Builds the config from SDAR's HF `config.json` (Qwen3 keys plus block_size, mask_token_id).

        Mixture-of-experts, attention biases, sliding windows and RoPE scaling are rejected, and so
        are another model's `model_type` / `architectures`, numbers written as strings, bools or
        fractions, and a missing `rope_theta` (top level, or in transformers 5's `rope_parameters`):
        the published configs give 1e6, while copies of SDAR's configuration code default to 1e6 or 1e4.
        An absent pad_token_id is <|endoftext|> for the Qwen tokenizer (stop ids holding <|im_end|>, or
        none), else the last stop id (a model of another vocabulary).
        """
        check_hf_names(hf, cls)
        bad = ["attention_bias=True"] if hf_flag(hf, "attention_bias", False) else []
        hf = cls.check_hf(hf, bad + qwen_refusals(hf), ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                         "intermediate_size", "vocab_size", "rope_theta"))
        hidden, heads = hf_int(hf, "hidden_size"), hf_int(hf, "num_attention_heads")
        eos = hf.get("eos_token_id")  # one id or a list of them
        eos = [QWEN_IM_END, QWEN_ENDOFTEXT] if eos is None else eos
        eos = tuple(hf_int({"eos_token_id": e}, "eos_token_id") for e in (eos if isinstance(eos, list) else [eos]))
        if QWEN_ENDOFTEXT in eos and QWEN_IM_END not in eos:
            # Qwen3 tokenizer: the chat models also stop at <|im_end|> (their generation_config.json)
            eos = (QWEN_IM_END,) + eos
        pad = QWEN_ENDOFTEXT if QWEN_IM_END in eos or not eos else eos[-1]
        head_dim = hf_int(hf, "head_dim", None)
        return cls(
            hidden_size=hidden, num_layers=hf_int(hf, "num_hidden_layers"), num_heads=heads,
            num_kv_heads=hf_int(hf, "num_key_value_heads", heads),
            head_dim=hidden // heads if head_dim is None else head_dim,
            intermediate_size=hf_int(hf, "intermediate_size"), vocab_size=hf_int(hf, "vocab_size"),
            rope_theta=hf_real(hf, "rope_theta"), rms_norm_eps=hf_real(hf, "rms_norm_eps", 1e-6),
            max_position_embeddings=hf_int(hf, "max_position_embeddings", 32768),
            tie_word_embeddings=hf_flag(hf, "tie_word_embeddings", False),
            block_size=hf_int(hf, "block_size", 4), mask_token_id=hf_int(hf, "mask_token_id", 151669),
            eos_token_ids=eos, pad_token_id=hf_int(hf, "pad_token_id", pad),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `config.json` dict (SDAR's Qwen3 keys) describing this config."""
        return {
            "architectures": ["SDARForCausalLM"], "model_type": "sdar",
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
            "vocab_size": self.vocab_size, "rope_theta": self.rope_theta, "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "block_size": self.block_size,
            "mask_token_id": self.mask_token_id, "eos_token_id": list(self.eos_token_ids),
            "pad_token_id": self.pad_token_id, "bos_token_id": 151643, "hidden_act": "silu",
            "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False,
        }


@dataclasses.dataclass(frozen=True, kw_only=True)
class DreamConfig(DecoderConfig):
    """Dream (Dream-v0-Instruct-7B / -Base-7B): a Qwen2.5-architecture masked-diffusion model.

    Attention is fully bidirectional, as LLaDA's; the checkpoint uses HF Qwen2 names and shapes (q/k/v
    biases, GQA, head_dim = hidden_size / num_heads). Dream predicts token i from position i - 1 (the
    logits are shifted by one position in generation, `dllm_jax.generate.dream`, not in the forward).
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

    HF_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
               "num_kv_heads": "num_key_value_heads"}
    TOKEN_IDS = ("mask_token_id", "eos_token_id", "pad_token_id", "bos_token_id")

    @property
    def head_dim(self) -> int:  # not on the base: SDAR and LLaDA2 make it a field
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> DreamConfig:
        """Builds the config from Dream's HF `config.json` (Qwen2 keys, model_type "Dream", mask_token_id).

        Sliding windows, RoPE scaling, another activation, a head_dim other than hidden_size /
        num_attention_heads (Qwen2 has no such key) and mixture-of-experts keys are rejected, and so are
        another model's `model_type` / `architectures` and a missing `rope_theta` (the published configs
        give 1e6; Qwen2's code default, 1e4, would silently change every rotation). Absent pad and bos
        ids are <|endoftext|> for the Qwen tokenizer (eos <|endoftext|> or <|im_end|>), else the eos id.
        """
        check_hf_names(hf, cls)
        bad = qwen_refusals(hf)
        if hf.get("head_dim") is not None and hf.get("hidden_size") and hf.get("num_attention_heads") and \
                hf_int(hf, "head_dim") * hf_int(hf, "num_attention_heads") != hf_int(hf, "hidden_size"):
            bad.append(f"head_dim={hf['head_dim']!r} (Dream's is hidden_size / num_attention_heads)")
        hf = cls.check_hf(hf, bad, ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                                    "vocab_size", "rope_theta"))
        heads = hf_int(hf, "num_attention_heads")
        eos = hf.get("eos_token_id")
        if isinstance(eos, list):  # the official sampler reads the first of a list
            eos = eos[0] if eos else None
        eos = QWEN_ENDOFTEXT if eos is None else hf_int({"eos_token_id": eos}, "eos_token_id")
        pad = QWEN_ENDOFTEXT if eos in (QWEN_ENDOFTEXT, QWEN_IM_END) else eos
        return cls(
            hidden_size=hf_int(hf, "hidden_size"), num_layers=hf_int(hf, "num_hidden_layers"), num_heads=heads,
            num_kv_heads=hf_int(hf, "num_key_value_heads", heads), intermediate_size=hf_int(hf, "intermediate_size"),
            vocab_size=hf_int(hf, "vocab_size"), rope_theta=hf_real(hf, "rope_theta"),
            rms_norm_eps=hf_real(hf, "rms_norm_eps", 1e-6),
            max_position_embeddings=hf_int(hf, "max_position_embeddings", 131072),
            tie_word_embeddings=hf_flag(hf, "tie_word_embeddings", False),
            mask_token_id=hf_int(hf, "mask_token_id", 151666), eos_token_id=eos,
            pad_token_id=hf_int(hf, "pad_token_id", pad), bos_token_id=hf_int(hf, "bos_token_id", pad),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `config.json` dict (Dream's Qwen2 keys) describing this config."""
        return {
            "architectures": ["DreamModel"], "model_type": "Dream",
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
            "rope_theta": self.rope_theta, "rope_scaling": None, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "mask_token_id": self.mask_token_id,
            "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id, "bos_token_id": self.bos_token_id,
            "hidden_act": "silu", "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
        }


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
    `block_size` is the sampler's default block length (32; not a key of the Hub config.json). Facts:
    dllm_jax/configs/llada2.0-mini/README.md.
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

    HF_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
               "num_kv_heads": "num_key_value_heads", "qkv_bias": "use_qkv_bias", "o_bias": "use_bias",
               "qk_norm": "use_qk_norm"}
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
    def from_hf_config(cls, hf: dict[str, Any]) -> LLaDA2Config:
        """Builds the config from LLaDA2's HF `config.json` (`llada2_moe`, `LLaDA2MoeModelLM`).

        Refused rather than ignored: another model's model_type / architectures, RoPE scaling, a
        sliding window, an activation other than silu, a score function other than sigmoid, numbers
        written as strings, bools or fractions, and a missing `rope_theta` (the published config gives
        600000; the configuration code's default, 10000, would change every rotation). An absent
        pad_token_id is the eos id.
        """
        check_hf_names(hf, cls)
        bad = qwen_refusals(hf, moe=False)
        if hf.get("score_function", "sigmoid") != "sigmoid":
            bad.append(f"score_function={hf['score_function']!r} (supported: 'sigmoid')")
        if hf.get("num_experts") is None:
            bad.append("num_experts=null (a dense model: the official code builds no MoE layer)")
        hf = cls.check_hf(hf, bad, ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                    "intermediate_size", "moe_intermediate_size", "num_experts",
                                    "num_experts_per_tok", "vocab_size", "rope_theta"))
        hidden, heads = hf_int(hf, "hidden_size"), hf_int(hf, "num_attention_heads")
        head_dim = hf_int(hf, "head_dim", None)
        eos = hf_int(hf, "eos_token_id", 156892)
        return cls(
            hidden_size=hidden, num_layers=hf_int(hf, "num_hidden_layers"), num_heads=heads,
            num_kv_heads=hf_int(hf, "num_key_value_heads"), head_dim=head_dim or hidden // heads,
            intermediate_size=hf_int(hf, "intermediate_size"),
            moe_intermediate_size=hf_int(hf, "moe_intermediate_size"), num_experts=hf_int(hf, "num_experts"),
            num_experts_per_tok=hf_int(hf, "num_experts_per_tok"),
            num_shared_experts=hf_int(hf, "num_shared_experts", 0), n_group=hf_int(hf, "n_group", 1),
            topk_group=hf_int(hf, "topk_group", 1),
            routed_scaling_factor=hf_real(hf, "routed_scaling_factor", 1.0),
            first_k_dense_replace=hf_int(hf, "first_k_dense_replace", 0), vocab_size=hf_int(hf, "vocab_size"),
            rope_theta=hf_real(hf, "rope_theta"), partial_rotary_factor=hf_real(hf, "partial_rotary_factor", 1.0),
            rms_norm_eps=hf_real(hf, "rms_norm_eps", 1e-5),
            max_position_embeddings=hf_int(hf, "max_position_embeddings", 32768),
            tie_word_embeddings=hf_flag(hf, "tie_word_embeddings", False),
            qkv_bias=hf_flag(hf, "use_qkv_bias", False), o_bias=hf_flag(hf, "use_bias", False),
            qk_norm=hf_flag(hf, "use_qk_norm", False),
            block_size=hf_int(hf, "block_size", 32), mask_token_id=hf_int(hf, "mask_token_id", 156895),
            eos_token_id=eos, pad_token_id=hf_int(hf, "pad_token_id", eos),
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The HF `config.json` dict (LLaDA2's keys) describing this config."""
        return {
            "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe",
            "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size, "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "num_shared_experts": self.num_shared_experts,
            "n_group": self.n_group, "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor, "first_k_dense_replace": self.first_k_dense_replace,
            "vocab_size": self.vocab_size, "rope_theta": self.rope_theta, "rope_scaling": None,
            "partial_rotary_factor": self.partial_rotary_factor, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings, "tie_word_embeddings": self.tie_word_embeddings,
            "use_qkv_bias": self.qkv_bias, "use_bias": self.o_bias, "use_qk_norm": self.qk_norm,
            "norm_topk_prob": True, "block_size": self.block_size,
            "mask_token_id": self.mask_token_id, "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id, "hidden_act": "silu", "score_function": "sigmoid",
            "moe_router_enable_expert_bias": True, "use_sliding_window": False,
        }


def field_label(config, name: str) -> str:
    """`LLaDAConfig.hidden_size (config.json key 'd_model')`: the field and where it comes from."""
    key = config.HF_KEYS.get(name, name)
    return f"{type(config).__name__}.{name}" + (f" (config.json key {key!r})" if key != name else "")


def token_id(label: str, value, vocab_size: int, hint: str = "") -> int:
    value = integer(label, value, minimum=0, hint=hint)
    if value >= vocab_size:
        # the id indexes the embedding and the logits: beyond them it would be clamped silently
        raise ValueError(f"{label}={value} lies beyond the vocabulary (vocab_size={vocab_size}: ids "
                         f"0..{vocab_size - 1}){hint}")
    return value


def check_fields(config, *, sizes: tuple[str, ...]) -> None:
    """Checks the sizes and numbers shared by the families, storing them as canonical int / float /
    bool (frozen dataclass: object.__setattr__), so that a numpy scalar does not make equal configs
    differ as static jit arguments."""
    for name in sizes:
        object.__setattr__(config, name, integer(field_label(config, name), getattr(config, name)))
    for name in ("rope_theta", "rms_norm_eps"):  # zero or negative: NaN or inf activations
        object.__setattr__(config, name, real(field_label(config, name), getattr(config, name), low=0, low_open=True))
    object.__setattr__(config, "tie_word_embeddings",
                       flag(field_label(config, "tie_word_embeddings"), config.tie_word_embeddings))


def check_token_ids(config, names: tuple[str, ...]) -> None:
    for name in names:
        object.__setattr__(config, name, token_id(field_label(config, name), getattr(config, name), config.vocab_size))


def check_mask_distinct(config, special_ids: tuple[int, ...]) -> None:
    """The mask id must not double as a stop or padding token: generated masks would read as stops,
    padding as positions to fill in."""
    if config.mask_token_id in special_ids:
        raise ValueError(f"{type(config).__name__}.mask_token_id={config.mask_token_id} is also a stop or padding "
                         f"token id ({special_ids}); the mask token must be its own id")


ModelConfig = DecoderConfig  # any family's config


REQUIRED = object()  # hf_* default: the key must be present


def hf_default(key: str, default):
    """The value of an absent or null key (HF writes null for "the default")."""
    if default is REQUIRED:
        raise ValueError(f"config.json lacks the required key {key!r}")
    return default


def hf_int(hf: dict, key: str, default=REQUIRED):
    """An integer key. JSON writers may print 64 as 64.0, which is accepted; "64", 64.5 and true are not."""
    value = hf.get(key)
    if value is None:
        return hf_default(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return integer(f"config.json key {key!r}", value, minimum=None)


def hf_real(hf: dict, key: str, default=REQUIRED) -> float:
    value = hf.get(key)
    return hf_default(key, default) if value is None else real(f"config.json key {key!r}", value)


def hf_flag(hf: dict, key: str, default=REQUIRED) -> bool:
    value = hf.get(key)
    return hf_default(key, default) if value is None else flag(f"config.json key {key!r}", value)


def hf_dict(hf: dict, key: str) -> dict:
    value = {} if hf.get(key) is None else hf[key]
    if not isinstance(value, dict):
        raise ValueError(f"config.json key {key!r} must be an object or null, got {value!r}")
    return value


def check_required(hf: dict, family: str, keys: tuple[str, ...]) -> None:
    missing = [k for k in keys if hf.get(k) is None]
    if missing:
        raise ValueError(f"{family} config.json lacks required keys {missing}")


def hf_architectures(hf: dict) -> list[str]:
    names = [] if hf.get("architectures") is None else hf["architectures"]
    if not isinstance(names, list) or not all(isinstance(a, str) for a in names):
        raise ValueError(f"config.json key 'architectures' must be a list of class names, got {names!r}")
    return names


def check_object(hf) -> None:
    if not isinstance(hf, dict):
        kinds = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}
        kind = kinds.get(type(hf), type(hf).__name__)
        raise ValueError(f"a config.json must hold a JSON object of keys, got {kind}: {hf!r:.80}")


def check_hf_names(hf, cls: type[DecoderConfig]) -> None:
    """Refuses a config.json that is not a JSON object, or whose model_type or architectures name
    another model than `cls`'s family: its weights would load under the wrong layer definitions."""
    check_object(hf)
    family, model_types, architectures = cls.LABEL, cls.MODEL_TYPES, cls.ARCHITECTURES
    model_type = hf.get("model_type")
    if model_type and str(model_type).lower() not in model_types:
        raise ValueError(f"config.json model_type={model_type!r} is not a {family} model (accepted: {model_types})")
    names = hf_architectures(hf)
    foreign = [a for a in names if a not in architectures]
    if foreign:
        raise ValueError(f"config.json architectures={names!r}: {foreign} is not a {family} architecture "
                         f"(accepted: {list(architectures)})")


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
