"""Frozen model configurations built from Hugging Face `config.json` files.

Field names are the same for every family (hidden_size, num_layers, ...) so that the shared
layers in `dllm_jax.models.layers` read any config; `from_hf_config` maps each family's own keys.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SHIPPED_CONFIG_DIR = Path(__file__).resolve().parent.parent / "checkpoints"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LLaDAConfig:
    """LLaDA (LLaDA-8B-Base/Instruct, LLaDA-1.5): a bidirectional Llama-style masked-diffusion model.

    `vocab_size` is the number of embedding rows and logits (LLaDA's `embedding_size`, which may
    be padded beyond the tokenizer's `vocab_size`, kept as `tokenizer_vocab_size`).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    tokenizer_vocab_size: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    mask_token_id: int = 126336
    eos_token_id: int = 126081
    pad_token_id: int = 126081
    eot_token_id: int = 126348  # <|eot_id|>; not in LLaDA's config.json (generate.py hard-codes it)

    family = "llada"
    # LLaDA rotates q/k in fp32 (rope_full_precision) and has no per-head q/k RMSNorm.
    rope_in_fp32 = True
    qk_norm = False

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "vocab_size", "tokenizer_vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LLaDAConfig.{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"{self.hidden_size=} must be a multiple of {self.num_heads=}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=} (GQA)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.tokenizer_vocab_size > self.vocab_size:
            raise ValueError(f"{self.tokenizer_vocab_size=} exceeds the embedding size {self.vocab_size=}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> LLaDAConfig:
        """Builds the config from the keys of LLaDA's HF `config.json` (OLMo-style names).

        Features the original model never uses (ALiBi, biases, QK layer norm, other block or norm
        types, logit scaling, qkv clipping) are rejected with a ValueError rather than ignored.
        """
        unsupported = {
            "alibi": (False, None), "rope": (True, None), "include_bias": (False, None),
            "include_qkv_bias": (False, None), "attention_layer_norm": (False, None),
            "scale_logits": (False, None), "input_emb_norm": (False, None),
            "layer_norm_type": ("rms", None), "activation_type": ("silu", None),
            "block_type": ("llama", None), "clip_qkv": (None,), "bias_for_layer_norm": (False, None),
        }
        bad = [f"{key}={hf[key]!r} (supported: {allowed[0]!r})"
               for key, allowed in unsupported.items() if key in hf and hf[key] not in allowed]
        if bad:
            raise ValueError("unsupported LLaDA config: " + ", ".join(bad))
        missing = [k for k in ("d_model", "n_heads", "n_layers", "vocab_size") if k not in hf]
        if missing:
            raise ValueError(f"LLaDA config.json lacks required keys {missing}")
        n_heads = int(hf["n_heads"])
        n_kv_heads = hf.get("n_kv_heads")
        if n_kv_heads is None:
            n_kv_heads = 1 if hf.get("multi_query_attention") else n_heads
        mlp = hf.get("mlp_hidden_size")
        if mlp is None:
            mlp = int(hf.get("mlp_ratio", 4)) * int(hf["d_model"])
        vocab = int(hf["vocab_size"])
        embedding = hf.get("embedding_size") or vocab
        return cls(
            hidden_size=int(hf["d_model"]), num_layers=int(hf["n_layers"]), num_heads=n_heads,
            num_kv_heads=int(n_kv_heads), intermediate_size=int(mlp), vocab_size=int(embedding),
            tokenizer_vocab_size=vocab, rope_theta=float(hf.get("rope_theta", 10000.0)),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(hf.get("max_sequence_length", 4096)),
            tie_word_embeddings=bool(hf.get("weight_tying", False)),
            mask_token_id=int(hf.get("mask_token_id", 126336)),
            eos_token_id=int(hf.get("eos_token_id", 126081)),
            pad_token_id=int(hf.get("pad_token_id", 126081)),
            eot_token_id=int(hf.get("eot_token_id", 126348)),
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class SDARConfig:
    """SDAR / TraDo: a Qwen3-architecture block-diffusion model.

    Attention is bidirectional inside each block of `block_size` tokens and causal across blocks,
    which is what makes an exact KV cache of finished blocks possible.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    block_size: int = 4
    mask_token_id: int = 151669
    eos_token_ids: tuple[int, ...] = (151645, 151643)
    pad_token_id: int = 151643

    family = "sdar"
    # Qwen3: per-head q/k RMSNorm before RoPE; cos/sin are cast to the activation dtype before
    # rotating (HF Qwen3), unlike LLaDA's fp32 rotation.
    rope_in_fp32 = False
    qk_norm = True

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "vocab_size", "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SDARConfig.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads=} must be a multiple of {self.num_kv_heads=} (GQA)")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> SDARConfig:
        """Builds the config from SDAR's HF `config.json` (Qwen3 keys plus block_size, mask_token_id).

        Mixture-of-experts, attention biases, sliding windows and RoPE scaling are rejected.
        """
        bad = []
        if hf.get("attention_bias"):
            bad.append("attention_bias=True")
        if hf.get("hidden_act", "silu") != "silu":
            bad.append(f"hidden_act={hf['hidden_act']!r} (supported: 'silu')")
        if hf.get("num_experts") or hf.get("moe_intermediate_size"):
            bad.append("mixture-of-experts layers (num_experts)")
        if hf.get("use_sliding_window"):
            bad.append("use_sliding_window=True")
        rope = hf.get("rope_scaling") or {}
        params = hf.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type")) or params.get("rope_type", "default")
        if rope_type != "default":
            bad.append(f"rope scaling {rope_type!r}")
        if bad:
            raise ValueError("unsupported SDAR config: " + ", ".join(bad))
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in hf]
        if missing:
            raise ValueError(f"SDAR config.json lacks required keys {missing}")
        heads = int(hf["num_attention_heads"])
        eos = hf.get("eos_token_id", [151645, 151643])
        eos = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        if 151643 in eos and 151645 not in eos:
            # Qwen3 tokenizer: the chat models also stop at <|im_end|> (their generation_config.json)
            eos = (151645,) + eos
        return cls(
            hidden_size=int(hf["hidden_size"]), num_layers=int(hf["num_hidden_layers"]), num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or int(hf["hidden_size"]) // heads),
            intermediate_size=int(hf["intermediate_size"]), vocab_size=int(hf["vocab_size"]),
            rope_theta=float(hf.get("rope_theta", params.get("rope_theta", 1000000.0))),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            block_size=int(hf.get("block_size", 4)), mask_token_id=int(hf.get("mask_token_id", 151669)),
            eos_token_ids=eos, pad_token_id=int(hf.get("pad_token_id") or 151643),
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


ModelConfig = LLaDAConfig | SDARConfig


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Detects the model family of an HF `config.json` dict and builds its config."""
    model_type = str(hf.get("model_type", "")).lower()
    architectures = [str(a).lower() for a in hf.get("architectures") or []]
    if model_type == "llada" or any("llada" in a for a in architectures):
        return LLaDAConfig.from_hf_config(hf)
    # TraDo checkpoints use SDAR's code; a plain Qwen3 layout loads as SDAR too (same weights).
    if model_type in ("sdar", "trado", "qwen3") or any("sdar" in a or "trado" in a for a in architectures):
        return SDARConfig.from_hf_config(hf)
    raise ValueError(
        f"unsupported model: model_type={hf.get('model_type')!r}, "
        f"architectures={hf.get('architectures')!r} (supported: LLaDA, SDAR/TraDo)")


def read_hf_config(directory: str | Path) -> tuple[dict[str, Any], ModelConfig]:
    """Reads `config.json` from a checkpoint directory: (raw dict, parsed config)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path} not found: a checkpoint directory needs its config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    return raw, config_from_hf(raw)


def shipped_config(name: str) -> ModelConfig:
    """The config of a supported public model, e.g. `shipped_config("llada-8b-instruct")`."""
    directory = SHIPPED_CONFIG_DIR / name
    if not (directory / "config.json").is_file():
        names = sorted(p.parent.name for p in SHIPPED_CONFIG_DIR.glob("*/config.json"))
        raise ValueError(f"no shipped config named {name!r}; available: {names}")
    return read_hf_config(directory)[1]
